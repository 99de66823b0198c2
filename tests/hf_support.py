"""Tiny HF checkpoints and native models for the adapter tests (no download)."""

import copy
import dataclasses
import inspect
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import transformers
from support import rows_forward

from torchtitan_npu.state_dict_adapters import get_adapter
from torchtitan_npu.state_dict_adapters import upstream_models as um

MODELS = ["llama3", "qwen3", "deepseek_v3", "qwen2"]
FLAVOR = "debugmodel"


def model_args(model: str, era: str, flavor: str = FLAVOR):
    """The debug flavor, made HF-expressible where upstream's differs.

    HF DeepseekV3 routes with normalized sigmoid scores and uses eps 1e-6 in
    its MLA norms; upstream's debug flavor uses softmax and eps 1e-5.
    """
    args = copy.deepcopy(um.model_args(model, flavor, era))
    if model != "deepseek_v3":
        return args
    if era == "trainspec":
        args.moe_args = dataclasses.replace(
            args.moe_args, score_func="sigmoid", route_norm=True
        )
        args.norm_eps = 1e-6
        return args
    return as_hf_deepseek(args)


def as_hf_deepseek(args):
    """A 0.3.x DeepSeek-V3 config (or one built on it: kimi_k2_7) routed as
    HF's DeepseekV3: sigmoid scores, normalized top-k, eps 1e-6 (in place)."""
    args.norm.eps = 1e-6
    for layer in args.layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = 1e-6
        layer.attention.kv_norm.eps = 1e-6
        if layer.moe:
            layer.moe.router.score_func = "sigmoid"
            layer.moe.router.route_norm = True
    return args


def hf_model(model: str, args, era: str, seed: int = 0) -> torch.nn.Module:
    layout, tied = um.describe(model, args, era)
    fields = get_adapter(model).hf_config(args, era, layout)
    fields["tie_word_embeddings"] = tied
    fields.pop("titan_npu_warning", None)
    architecture = fields.pop("architectures")[0]
    config = transformers.AutoConfig.for_model(**fields)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    hf = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # HF zero-inits some params (biases); make all count
        for p in hf.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return hf


def save_hf(hf: torch.nn.Module, path: Path) -> Path:
    hf.save_pretrained(path, max_shard_size="2MB")  # several shards + index
    return path


def native_model(model: str, args, era: str, seed: int = 0) -> torch.nn.Module:
    """The native model on CPU, initialized (buffers included)."""
    torch.manual_seed(seed)
    if era == "trainspec":
        from torchtitan.protocols.train_spec import get_train_spec

        args = copy.deepcopy(args)
        if hasattr(args, "moe_args") and not hasattr(args, "moe_impl"):
            args.moe_impl = "standard"
        module = get_train_spec(model).model_cls(args)
    else:
        module = args.build()
    with torch.no_grad():
        try:
            module.init_weights(buffer_device=torch.device("cpu"))
        except TypeError:
            module.init_weights()
    return module.eval()


def load_native(module: torch.nn.Module, checkpoint: Path) -> None:
    state = module.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint))
    module.load_state_dict(state)


def save_native(module: torch.nn.Module, checkpoint: Path) -> None:
    dcp.save(module.state_dict(), checkpoint_id=str(checkpoint))


def native_logits(module: torch.nn.Module, tokens: torch.Tensor, era: str):
    with torch.no_grad():
        if era == "trainspec":
            masks = inspect.signature(module.forward).parameters.get("attention_masks")
            if masks is None or masks.default is not inspect.Parameter.empty:
                return module(tokens)
            # 0.2.x models that require masks (gpt_oss, flex only): causal
            # masks need no tokenizer
            return module(tokens, module.get_attention_masks(tokens, None))
        if not hasattr(module, "get_attention_masks"):  # titan-npu's qwen2
            return module(tokens)
        return rows_forward(module, tokens)


def hf_logits(hf: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens).logits
