"""Qwen2 on the config-registry era (torchtitan 0.3.x), built the upstream way.

0.3.x builds decoders from configurable parts, and Qwen2 is one of them:
upstream's Qwen3 decoder (pre-norm blocks, grouped-query attention, SwiGLU
feed-forward, rotate-half RoPE) with biases on the q/k/v projections and no
q/k norms. So the kernel converters, upstream's sharding (FSDP, TP, CP, DDP)
and pipelining apply to it as to qwen3. The shapes come from ``FLAVORS``;
``qwen2_<flavor>`` are the ``Trainer.Config`` functions.
"""

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch.nn as nn
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import QKVLinear
from torchtitan.models.common.config_utils import (
    decoder_vocab_size,
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_npu.compat.era import Era
from torchtitan_npu.models.qwen2.args import FLAVORS, Qwen2ModelArgs
from torchtitan_npu.models.rope import rope_config

_LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.normal_, std=0.02),
    "bias": nn.init.zeros_,
}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=0.02)}
_TIED_EMBEDDING_INIT = {"weight": skip_param_init}  # the lm_head's init covers it


def _norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT)


def _layer(args: Qwen2ModelArgs, attn_backend: str) -> Qwen3TransformerBlock.Config:
    head_dim = args.head_dim
    attention = make_gqa_config(
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=head_dim,
        wqkv_param_init=_LINEAR_INIT,
        wo_param_init=_LINEAR_INIT,
        inner_attention=get_attention_config(attn_backend),
        rope=rope_config(
            CosSinRoPE.Config, args.max_seq_len, dim=head_dim, theta=args.rope_theta
        ),
    )
    qkv = attention.qkv_linear
    assert isinstance(qkv, QKVLinear.Config)  # separate wq and wk/wv
    qkv.wq.bias = qkv.wkv.bias = True  # Qwen2's q/k/v projections carry biases
    return Qwen3TransformerBlock.Config(
        attention_norm=_norm(args.dim, args.norm_eps),
        ffn_norm=_norm(args.dim, args.norm_eps),
        attention=attention,
        feed_forward=make_ffn_config(
            dim=args.dim,
            hidden_dim=args.hidden_dim,
            w1_param_init=_LINEAR_INIT,
            w2w3_param_init=_LINEAR_INIT,
        ),
    )


def model_config(args: Qwen2ModelArgs, attn_backend: str = "flex") -> Any:
    """The decoder config of a Qwen2 flavor."""
    return Qwen3Model.Config(
        vocab_size=args.vocab_size,
        dim=args.dim,
        norm=_norm(args.dim, args.norm_eps),
        enable_weight_tying=args.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=args.vocab_size,
            embedding_dim=args.dim,
            param_init=_TIED_EMBEDDING_INIT if args.tie_embeddings else _EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(
            in_features=args.dim, out_features=args.vocab_size, param_init=_LINEAR_INIT
        ),
        layers=[_layer(args, attn_backend) for _ in range(args.n_layers)],
    )


def model_registry(flavor: str, attn_backend: str = "flex") -> ModelSpec:
    from torchtitan_npu.state_dict_adapters.upstream_adapter import adapter_class

    return ModelSpec(
        name="qwen2",
        flavor=flavor,
        model=model_config(copy.deepcopy(FLAVORS[flavor]), attn_backend),
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter_class("qwen2", Era.CONFIG_REGISTRY),
    )


def _trainer_config(flavor: str) -> Any:
    """llama3's debug Trainer.Config (optimizer, scheduler, data, checkpoint)
    with the Qwen2 model and its vocabulary."""
    config = llama3_debugmodel()
    config.model_spec = model_registry(flavor)
    loss = config.loss
    assert isinstance(loss, ChunkedLossWrapper.Config)
    assert isinstance(loss.loss_fn, CrossEntropyLoss.Config)
    loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    return config


def qwen2_debugmodel() -> Any:
    return _trainer_config("debugmodel")


def qwen2_debugmodel_tied() -> Any:
    return _trainer_config("debugmodel_tied")


def qwen2_0_5b() -> Any:
    return _trainer_config("0.5B")


def qwen2_1_5b() -> Any:
    return _trainer_config("1.5B")


def qwen2_7b() -> Any:
    return _trainer_config("7B")
