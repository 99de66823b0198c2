"""``--model.flavor hf``: train the model of a HF directory.

``titan-npu train --model.flavor hf --model.hf_assets_path DIR`` takes

- the architecture from ``DIR/config.json`` (``state_dict_adapters/
  architecture.py``; the model name from its ``model_type``),
- the weights from DIR's safetensors, loaded by upstream's checkpointer through
  titan-npu's HF adapter (``checkpoint.initial_load_in_hf``), unless
  ``checkpoint.initial_load_path`` names another checkpoint (a converted DCP),
- the tokenizer from DIR, as upstream does with ``hf_assets_path``.
"""

from pathlib import Path
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.errors import ConfigError, ConversionError

# What upstream's HuggingFaceTokenizer reads from hf_assets_path (every era)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


def wanted(config: dict[str, Any]) -> bool:
    from torchtitan_npu.models import HF_FLAVOR

    return config.get("model", {}).get("flavor") == HF_FLAVOR


def prepare(config: dict[str, Any]) -> None:
    """While the config is resolved: check DIR, name the model, point the
    checkpoint at DIR's weights (the resolved config then says all of it)."""
    if not wanted(config):
        return
    from torchtitan_npu.distributed import check_torch_loads

    check_torch_loads()  # the adapters import torch: a broken torch_npu is one line
    from torchtitan_npu.state_dict_adapters import architecture

    model = config["model"]
    directory = Path(model.get("hf_assets_path", ""))
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.flavor hf reads the architecture from model.hf_assets_path/"
            f"config.json, and {directory / 'config.json'} does not exist; set "
            "--model.hf_assets_path to a HF model directory"
        )
    hf_config = _read(directory)
    name = architecture.model_for(hf_config)
    if name is None:
        raise ConfigError(
            f"{directory / 'config.json'}: model_type {hf_config.get('model_type')!r} "
            "is no model titan-npu can build from config.json"
        )
    model["name"] = name  # the resolved config (titan_npu_config.json) says so
    checkpoint = config.setdefault("checkpoint", {})
    if not checkpoint.get("initial_load_path"):
        if hf_config.get("quantization_config"):
            raise ConfigError(
                f"{directory} holds quantized weights, which training does not "
                f"dequantize; convert them first (titan-npu convert from-hf "
                f"{directory} OUT --model {name}) and pass "
                "--checkpoint.initial_load_path OUT"
            )
        if not any(directory.glob("*.safetensors")):
            raise ConfigError(
                f"{directory} has no *.safetensors weights; set "
                "--checkpoint.initial_load_path to a checkpoint to start from"
            )
        checkpoint.update(initial_load_path=str(directory), initial_load_in_hf=True)
    checkpoint["enable"] = True  # the weights are the point of an HF model


def register(config: dict[str, Any], era: Era) -> None:
    """In every process, before translation: flavor ``hf`` of the model is
    derived from config.json and registered."""
    if not wanted(config):
        return
    from torchtitan_npu.state_dict_adapters import architecture

    model = config["model"]
    try:
        architecture.register(model["name"], model["hf_assets_path"], era)
    except ConversionError as e:
        raise ConfigError(
            f"model.flavor hf from {Path(model['hf_assets_path']) / 'config.json'}: "
            + "; ".join(e.problems)
        ) from None


def check_tokenizer(folder: str | None, vocab_size: int | None, model: str) -> None:
    """`folder` holds a tokenizer upstream reads, and the ids it can give have
    rows in `model`'s embedding (an id past it fails every rank: an IndexError
    on CPU, a device-side assert on CUDA)."""
    if not folder or not vocab_size or "://" in folder:
        return
    if not any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
        sentencepiece = (Path(folder) / "tokenizer.model").is_file()
        raise ConfigError(
            f"model.hf_assets_path {folder} has no tokenizer upstream reads "
            f"({', '.join(TOKENIZER_FILES)})"
            + (
                "; a SentencePiece tokenizer.model alone is not read: save it as "
                "tokenizer.json (transformers: AutoTokenizer.from_pretrained(DIR)"
                ".save_pretrained(DIR))"
                if sentencepiece
                else "; point it at the model's tokenizer files"
            )
        )
    tokens = tokenizer_size(Path(folder) / "tokenizer.json")
    if tokens is not None and tokens > vocab_size:
        raise ConfigError(
            f"the tokenizer in {folder} has {tokens} tokens and {model} embeds "
            f"{vocab_size} (its vocab_size): ids from {vocab_size} up have no "
            "embedding; use the model's own tokenizer (--model.hf_assets_path) "
            f"or a flavor whose vocab_size is at least {tokens}"
        )


def tokenizer_size(path: Path) -> int | None:
    """One more than the largest id of a HF tokenizer.json (added tokens
    included); None when there is none or it cannot be read (upstream says
    why)."""
    import json

    try:
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
        ids += [token["id"] for token in data.get("added_tokens") or []]
        return max(ids) + 1
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read(directory: Path) -> dict[str, Any]:
    from torchtitan_npu.state_dict_adapters import architecture

    try:
        return architecture.read_config(directory)
    except ConversionError as e:
        raise ConfigError(
            f"{directory / 'config.json'}: {'; '.join(e.problems)}"
        ) from None
