"""Qwen2: a decoder with q/k/v biases, GQA, RoPE (rotate-half, as in HF) and
optionally tied embeddings. Single-device semantics: parallelism is applied
from outside (parallelize.py); layers are a ModuleDict so pipeline stages
keep stable FQNs; the input/output modules may be None on a PP stage."""

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_npu.models.qwen2.args import Qwen2ModelArgs


def rope_cache(args: Qwen2ModelArgs, device: Any = None) -> torch.Tensor:
    """cos/sin of every position, (max_seq_len, 2, head_dim) in fp32."""
    half = args.head_dim // 2
    inv_freq = 1.0 / args.rope_theta ** (
        torch.arange(0, half, device=device, dtype=torch.float32) / half
    )
    angles = torch.outer(torch.arange(args.max_seq_len, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); rotate halves."""
    cos = cache[: x.shape[1], 0][None, :, None, :]
    sin = cache[: x.shape[1], 1][None, :, None, :]
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Qwen2ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, kv_dim, bias=True)
        self.wv = nn.Linear(args.dim, kv_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1: the local head count (heads are split under tensor parallelism)
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        nn.init.trunc_normal_(self.wo.weight, std=std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=std)
        nn.init.trunc_normal_(self.w3.weight, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen2ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.depth_std)
        self.feed_forward.init_weights(self.depth_std)


class Qwen2Model(nn.Module):
    """The output projection is called HEAD: ``output`` (0.2.x pipeline
    splitting expects it); the 0.3.x subclass calls it ``lm_head``."""

    HEAD = "output"

    def __init__(self, args: Qwen2ModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        setattr(self, self.HEAD, nn.Linear(args.dim, args.vocab_size, bias=False))
        self.register_buffer("rope_cache", rope_cache(args), persistent=False)
        if args.tie_embeddings:
            getattr(self, self.HEAD).weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, **unused) -> torch.Tensor:
        """tokens (batch, seq) -> logits; on a PP stage, hidden states in/out."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        h = self.norm(h) if self.norm is not None else h
        head = getattr(self, self.HEAD)
        return head(h) if head is not None else h

    def init_weights(self, buffer_device: torch.device | None = None, **unused) -> None:
        """Initialize everything (after meta-device build + sharding)."""
        head = getattr(self, self.HEAD)
        if self.model_args.tie_embeddings and None not in (head, self.tok_embeddings):
            # to_empty after the meta-device build gave each module its own
            # tensor: tie them again before initializing
            head.weight = self.tok_embeddings.weight
        device = buffer_device or self.rope_cache.device
        with torch.device(device):
            self.rope_cache = rope_cache(self.model_args, device)
        if self.tok_embeddings is not None:
            std = 0.02 if self.model_args.tie_embeddings else 1.0
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            # pyrefly: ignore[not-callable]  # ModuleDict values are typed Module
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if head is not None and not self.model_args.tie_embeddings:
            bound = self.model_args.dim**-0.5
            nn.init.trunc_normal_(head.weight, std=bound, a=-3 * bound, b=3 * bound)
