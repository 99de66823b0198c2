"""titan-npu: a fork-free overlay that trains upstream torchtitan on npu/cuda/cpu.

Importing this package is cheap; the overlay activates when upstream
``torchtitan`` is imported (see ``torchtitan_npu.bootstrap``).
"""

import os

if os.environ.get("TITAN_NPU_NO_BOOTSTRAP") != "1":
    from torchtitan_npu import bootstrap as _bootstrap

    _bootstrap.install()

__version__ = "0.1.0"
