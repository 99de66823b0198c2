"""The project's train-config format: TOML plus ``--section.key value`` overrides.

A config is a nested dict ``{section: {key: value}}`` in upstream 0.2.x TOML
layout (``[job] [model] [training] [parallelism] [checkpoint] ...``).
``EMBEDDED`` values stand for the embedded corpus and tokenizer.
"""

import difflib
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torchtitan_npu.errors import ConfigError

EMBEDDED = "embedded"
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_CONFIG = MODELS_DIR / "llama3" / "train_configs" / "debug_model.toml"


def wrong_type(key: str, value: Any, want: str, version: str) -> ConfigError:
    return ConfigError(
        f"train config key {key!r} = {value!r}: expected {want} "
        f"(torchtitan {version}); set it in the TOML or with --{key} VALUE"
    )


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"train config {path} is a directory; pass a TOML file")
    if not path.is_file():
        raise ConfigError(f"train config {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"train config {path} is not valid TOML: {e}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"train config {path} cannot be read: {e}") from e


def parse_value(text: str) -> Any:
    """A TOML literal when it parses as one (1, 2.5, true, [1, 2]), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--a.b value`` / ``--a.b=value`` pairs as ``{"a.b": value}``."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"expected a --section.key override, got {arg!r} "
                "(example: --training.steps 50)"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                value = "true"  # a bare flag: --checkpoint.enable
            else:
                i += 1
                value = args[i]
        overrides[key.replace("-", "_")] = parse_value(value)
        i += 1
    return overrides


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    for dotted, value in overrides.items():
        *sections, key = dotted.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{dotted}: {section} is not a section")
        node[key] = value


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"training": {"steps": 3}}`` -> ``{"training.steps": 3}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resolve(config_path: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """Read a train config, apply overrides and fill in what it leaves to
    titan-npu: the embedded assets, absolute paths, an HF directory's model.
    Every normalization happens here; the checks after it (preflight) only
    read the config."""
    config = load_toml(config_path or DEFAULT_CONFIG)
    apply_overrides(config, parse_overrides(overrides))
    model = config.setdefault("model", {})
    model.setdefault("name", "llama3")  # upstream 0.2.x's defaults, on every era
    model.setdefault("flavor", "debugmodel")
    training = config.setdefault("training", {})
    validation = config.get("validation", {})
    if (
        validation.get("enable")
        and training.get("dataset") == EMBEDDED
        and not {"dataset", "dataset_path"} & set(validation)
    ):
        validation["dataset"] = EMBEDDED  # not upstream's c4_validation download
    if EMBEDDED in (
        model.get("hf_assets_path", EMBEDDED),
        training.get("dataset"),
        validation.get("dataset"),
    ):
        from torchtitan_npu.assets import ensure_default_assets

        assets = ensure_default_assets()
        if model.get("hf_assets_path", EMBEDDED) == EMBEDDED:
            model["hf_assets_path"] = str(assets.tokenizer_path)
        _embedded_data(training, "training", assets.dataset_path)
        _embedded_data(validation, "validation", assets.validation_path)
    resolve_paths(config)
    from torchtitan_npu.config import hf_model

    hf_model.prepare(config)  # --model.flavor hf: the model and weights it names
    return config


def resolve_paths(config: dict[str, Any]) -> None:
    """Paths the ranks read, checked to exist and made absolute (upstream
    0.3.x requires an absolute initial_load_path)."""
    for section, key, what in [
        ("model", "hf_assets_path", "tokenizer/HF assets folder"),
        ("training", "dataset_path", "dataset path"),
        ("validation", "dataset_path", "validation dataset path"),
        ("checkpoint", "initial_load_path", "checkpoint to start from"),
    ]:
        value = config.get(section, {}).get(key)
        if not value:
            continue
        if not isinstance(value, str):
            raise ConfigError(f"{section}.{key} = {value!r}: expected a path")
        if "://" in value:
            continue  # remote storage: upstream reads it
        path = Path(value).expanduser()
        if not path.exists():
            embedded = ", or embedded" if key == "hf_assets_path" else ""
            raise ConfigError(
                f"{section}.{key}: {what} {value} does not exist "
                f"(set --{section}.{key} PATH{embedded})"
            )
        config[section][key] = str(path.resolve())


def _embedded_data(section: dict[str, Any], name: str, path: Path) -> None:
    """An ``embedded`` dataset: upstream's local-JSON loader on the embedded
    corpus (training) or its held-out part (validation)."""
    if section.get("dataset") != EMBEDDED:
        return
    if section.get("dataset_path"):
        raise ConfigError(
            f"{name}.dataset_path is set but {name}.dataset is {EMBEDDED!r}; to "
            f"use your own data also set --{name}.dataset (e.g. c4_test for a "
            "local JSON corpus)"
        )
    section["dataset"] = "c4_test"
    section["dataset_path"] = str(path)


def did_you_mean(value: str, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the known name spelled alike but for case,
    else the closest known name, if one is close."""
    known = list(known)
    close = [k for k in known if k.lower() == value.lower()]
    close = close or difflib.get_close_matches(value, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
