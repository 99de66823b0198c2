"""The built-in converters, one module per op: its kernel pair (torch_npu and
PyTorch-native) and what it replaces in each upstream era. Importing this
package registers them all."""

from torchtitan_npu.converters.ops import (  # noqa: F401  (registers)
    attention,
    grouped_mm,
    rms_norm,
    rope,
    swiglu,
    token_permute,
)
