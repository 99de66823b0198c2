"""`titan-npu plan`: per-rank device memory of a training run, before launch.

- ``estimate.py``: one rank of the run, built by the era's ``plan/<era>.py``
  as upstream builds it, stepped on fake tensors under a fake process group
  and PyTorch's memory tracker (``measure``: the same on real tensors, to
  check the estimate);
- ``search.py``: the layouts a device count allows, planned and ranked;
- ``devices.py``: device memory table and memory sizes;
- ``report.py``: tables and the plot.
"""
