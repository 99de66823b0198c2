"""Numerics: capture a step's module outputs and gradients in the ranks
(``hooks``), compare two setups' captures (``compare``), run both setups from
one seed on one batch (``locate``).

Importing this package does not import torch.
"""

# The ranks' numerics spec (JSON), set by the command that launches them.
ENV = "TITAN_NPU_NUMERICS"
