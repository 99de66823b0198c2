"""PyTorch-native kernels titan-npu supplies where upstream's need a device
or a package this machine lacks: the gated delta rule (gated_delta.py) and
the flash-linear-attention stand-in built on it (fla_standin.py), and a
reference varlen attention (varlen_attention.py). Overlay records put them in
place; nothing here patches anything."""
