"""HCCL wiring: SUM-only reductions, the flight recorder's environment, and
what Ascend needs for bitwise reruns.

HCCL reduces with SUM, PROD, MAX and MIN only: no AVG, no PREMUL_SUM. FSDP2's
gradient reduction is handled by the ``fsdp_sum_reduction`` patch;
``mean_by_sum`` does the same for torchtitan's ``dist_mean`` (loss logging).

torchtitan configures PyTorch's flight recorder through TORCH_NCCL_* /
TORCH_FR_* variables right before it creates the process group; torch_npu
reads its own names. ``translate_nccl_env`` copies each one across.
"""

import os
from collections.abc import Callable, MutableMapping

# torchtitan's variable -> torch_npu's (ProcessGroupHCCL, flight recorder)
NCCL_TO_HCCL = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_HCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_BUFFER_SIZE": "TORCH_HCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "TORCH_HCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_HCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_HCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "HCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ENABLE_MONITORING": "TORCH_HCCL_ENABLE_MONITORING",
}
MONITORING = "TORCH_HCCL_ENABLE_MONITORING"
TRACE_BUFFER = "TORCH_HCCL_TRACE_BUFFER_SIZE"


# Bitwise reruns on Ascend need more than torch.use_deterministic_algorithms
# (which upstream's debug.deterministic sets): collectives that reduce in a
# fixed order (HCCL, and LCCL when HCCL_OP_EXPANSION_MODE=AIV routes through
# it) and matmuls that keep their K-axis order. CANN reads these when the
# communicator and the kernels are set up, so they are set before torchrun
# starts the ranks; the field's recipes (Huawei torchtitan-npu, MindSpeed,
# vllm-ascend) set the same three together.
DETERMINISTIC_ENV = {
    "HCCL_DETERMINISTIC": "true",
    "LCCL_DETERMINISTIC": "1",
    "CLOSE_MATMUL_K_SHIFT": "1",
}


def deterministic_env(
    config: dict, device_type: str, environ: MutableMapping[str, str] = os.environ
) -> dict[str, str]:
    """The variables a run with ``debug.deterministic`` needs on npu that the
    user has not set (their own values win); none elsewhere."""
    if device_type != "npu" or not config.get("debug", {}).get("deterministic"):
        return {}
    return {k: v for k, v in DETERMINISTIC_ENV.items() if k not in environ}


def translate_nccl_env(environ: MutableMapping[str, str] = os.environ) -> dict:
    """Set each HCCL twin of a set NCCL variable; a user's own HCCL value wins.

    A trace buffer also switches HCCL monitoring on (torch_npu dumps the
    recorder from its monitoring thread). Returns what was set.
    """
    added = {}
    for nccl, hccl in NCCL_TO_HCCL.items():
        if nccl in environ and hccl not in environ and hccl not in added:
            added[hccl] = environ[nccl]
    if int(added.get(TRACE_BUFFER, "0") or 0) > 0 and MONITORING not in environ:
        added.setdefault(MONITORING, "1")
    environ.update(added)
    return added


def mean_by_sum(dist_sum: Callable) -> Callable:
    """torchtitan's ``dist_mean(x, mesh, extra_pg)`` as a SUM and a division."""
    import torch.distributed as dist

    def dist_mean(x, mesh=None, extra_pg=None):
        size = mesh.size() if mesh is not None else 1
        if extra_pg is not None:
            size *= dist.get_world_size(extra_pg)
        return dist_sum(x, mesh, extra_pg) / size

    return dist_mean
