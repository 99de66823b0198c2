"""``python native_logits.py CKPT OUT.pt``: the installed upstream's llama3
debugmodel, weights from DCP checkpoint CKPT, fp32 logits of fixed tokens
saved to OUT.pt. Run under either upstream (the matrix's `upgrade` cell)."""

import sys

import torch
from hf_support import load_native, native_logits, native_model

from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.convert import current_era

TOKENS = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))


def main(checkpoint: str, out: str) -> None:
    era = current_era()
    module = native_model(
        "llama3", um.model_args("llama3", "debugmodel", era), era.value
    )
    load_native(module, checkpoint)
    torch.save(native_logits(module, TOKENS, era.value), out)


if __name__ == "__main__":
    main(*sys.argv[1:])
