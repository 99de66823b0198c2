"""The field table: upstream's own config fields (type, default) as the train
config spells them, and the early check that reads its cache without
importing torch or upstream."""

import json
import subprocess
import sys

import pytest

from torchtitan_npu.bootstrap import activate
from torchtitan_npu.config import ConfigError, era_config, field_table, preflight
from torchtitan_npu.config import resolve as resolve_config
from torchtitan_npu.config.fields import get_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def resolve(*overrides: str) -> dict:
    return resolve_config(None, list(overrides))


def table_of(config: dict) -> field_table.FieldTable:
    activation = activate()
    era = era_config(activation.context.era)
    version = activation.upstream.installed.version
    return era.fields_of(config, version=version, device_type="cpu")


def upstream_defaults():
    """The installed upstream's own config object (0.3.x: the model's config
    function's Trainer.Config; 0.2.x: JobConfig)."""
    activation = activate()
    if activation.context.era.value == "trainspec":
        from torchtitan.config import JobConfig  # pyrefly: ignore

        return JobConfig()
    from torchtitan_npu.config.config_registry import base_config

    return base_config("llama3", "debugmodel")


def test_types_and_defaults_are_read_from_upstream(cache):
    table = table_of(resolve())
    defaults = upstream_defaults()
    for key in (
        "training.steps",
        "parallelism.data_parallel_shard_degree",
        "parallelism.tensor_parallel_degree",
        "metrics.log_freq",
    ):
        assert table.fields[key]["type"] == "int", key
        assert table.default(key) == get_path(defaults, key), key
    assert table.fields["training.steps"]["type"] == "int"
    assert "training.stepz" not in table.fields


def test_translate_and_the_early_check_say_the_same(cache):
    config = resolve("--training.stepz", "3")
    with pytest.raises(ConfigError) as full:
        preflight.check(config, world_size=1, launch="1 x 1")  # caches the table
    with pytest.raises(ConfigError) as early:
        preflight.check_early(config, world_size=1, launch="1 x 1")
    assert str(early.value) == str(full.value)
    assert "did you mean 'training.steps'" in str(early.value)
    with pytest.raises(ConfigError, match="'abc': expected an integer"):
        preflight.check_early(
            resolve("--training.steps", "abc"), world_size=1, launch="1 x 1"
        )
    tp = resolve("--parallelism.tensor_parallel_degree", "2")
    with pytest.raises(ConfigError, match="needs a multiple of 2 processes"):
        preflight.check_early(tp, world_size=1, launch="1 x 1")
    preflight.check_early(resolve(), world_size=1, launch="1 x 1")  # a good one
    # As translate: converters as text (the command line's comma list) too.
    converters = resolve("--model.converters", "rms_norm,rope")
    preflight.check_early(converters, world_size=1, launch="1 x 1")


def test_the_early_check_imports_neither_torch_nor_upstream(cache):
    preflight.check(resolve(), world_size=1, launch="1 x 1")  # caches the table
    code = (
        "import sys\n"
        "from torchtitan_npu.config import preflight, resolve\n"
        "from torchtitan_npu.errors import ConfigError\n"
        "try:\n"
        "    preflight.check_early(resolve(None, ['--training.stepz', '3']),"
        " world_size=1, launch='1 x 1')\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
        "print(sorted(m for m in ('torch', 'torchtitan') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    said, imported = result.stdout.strip().splitlines()
    assert "'training.stepz' has no counterpart" in said
    assert imported == "[]"


def test_a_table_is_one_per_upstream_and_shaping_values(cache):
    shaping = era_config(activate().context.era).SHAPING_KEYS
    config = resolve()
    preflight.check(config, world_size=1, launch="1 x 1")
    assert field_table.load(config, shaping) is not None
    other = resolve("--model.flavor", "other")
    assert (
        field_table.cache_path(other, shaping)
        != field_table.cache_path(config, shaping)
        or not shaping
    )  # 0.2.x: JobConfig is one class for every model
    path = field_table.cache_path(config, shaping)
    assert path is not None and path.parent.parent == cache / "field-tables"
    path.write_text("{not json")  # a damaged cache is no table, not an error
    assert field_table.load(config, shaping) is None
    preflight.check_early(resolve("--training.stepz", "3"), world_size=1, launch="")
    path.write_text(json.dumps({"version": "x"}))
    assert field_table.load(config, shaping) is None
