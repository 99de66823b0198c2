"""Qwen2 model arguments (Qwen2 / Qwen2.5 family) and the flavors."""

from dataclasses import dataclass

import torch.nn as nn


@dataclass
class Qwen2ModelArgs:
    dim: int = 896
    n_layers: int = 24
    n_heads: int = 14
    n_kv_heads: int = 2
    vocab_size: int = 151936
    hidden_dim: int = 4864
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 32768
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(parameters, training FLOPs per token) for throughput and MFU:
        6 x non-embedding parameters + attention's 12 * layers * dim * seq."""
        nparams = sum(p.numel() for p in model.parameters())
        embedding = sum(
            p.numel() for n, p in model.named_parameters() if "tok_embeddings" in n
        )
        attention = 12 * self.n_layers * self.dim * seq_len
        return nparams, 6 * (nparams - embedding) + attention


FLAVORS = {
    # untied, so pipeline stages do not share a weight
    "debugmodel": Qwen2ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=2048,
        hidden_dim=704, max_seq_len=2048, tie_embeddings=False,
    ),
    "debugmodel_tied": Qwen2ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=2048,
        hidden_dim=704, max_seq_len=2048,
    ),
    # The real Qwen2.5 shapes (config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B}).
    "0.5B": Qwen2ModelArgs(),
    "1.5B": Qwen2ModelArgs(
        dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, hidden_dim=8960,
    ),
    "7B": Qwen2ModelArgs(
        dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064,
        hidden_dim=18944, max_seq_len=131072, tie_embeddings=False,
    ),
}  # fmt: skip
