"""`plan --measure`, one rank: ``python -m torchtitan_npu.plan.measure
CONFIG.json OUT_DIR`` under torchrun. It takes the plan's two steps on real
tensors on this rank's device and writes what the same memory tracker saw
(OUT_DIR/rank-N.json), to set beside the estimate."""

import dataclasses
import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    config_file, out = argv
    from torchtitan_npu.bootstrap import activate

    activation = activate()  # imports torchtitan, applies the overlay
    import torch
    import torch.distributed as dist

    from torchtitan_npu.distributed import backend_for
    from torchtitan_npu.plan.estimate import measure

    device_type = activation.context.device_type
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(device_type)
    if device_type != "cpu":
        device = torch.device(device_type, local_rank)
    dist.init_process_group(backend_for(device_type))
    try:
        result = measure(json.loads(Path(config_file).read_text()), device)
        path = Path(out) / f"rank-{dist.get_rank()}.json"
        path.write_text(json.dumps(dataclasses.asdict(result)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
