"""What runs and commands report, and how: peak FLOPs for MFU (flops.py),
the NPU profiler (npu_profiler.py), upstream log lines that are noise under
titan-npu (log_noise.py), and text tables (table.py)."""
