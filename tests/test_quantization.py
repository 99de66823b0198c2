"""Upstream's low-precision training (float8, MX) through the one config format:
the same names and keys on both eras, checked before launch; emulated float8
trains on CPU where torchao is installed (`nox -s torchao`)."""

import importlib.util

import pytest
from support import requires_era, train

from torchtitan_npu.compat import resolve_upstream
from torchtitan_npu.config import ConfigError, era_config, resolve
from torchtitan_npu.config.schema import apply_overrides
from torchtitan_npu.tools.scalars import LOSS

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
FLOAT8 = "quantize.linear.float8"


def translate(overrides: dict):
    """The installed era's translation of the default config with ``overrides``."""
    installed = resolve_upstream()
    config = resolve(None, [])
    apply_overrides(config, overrides)
    return era_config(installed.era).translate(
        config, version=installed.installed.version, device_type="cpu"
    )


def test_a_bare_format_name_points_at_upstreams_converter(upstream):
    with pytest.raises(ConfigError) as info:
        translate({"model.converters": ["float8"]})
    message = str(info.value)
    assert message.startswith("unknown converter 'float8' (did you mean ")
    assert f"'{FLOAT8}'" in message and "'quantize.grouped_mm.float8'" in message


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"model.converters": ["quantize.linear.mx"]},
            r"'quantize.linear.mx' needs a CUDA device of compute capability 10.0 "
            r"or later \(this run: cpu\); drop it from model.converters$",
        ),
        (
            {"model.converters": [FLOAT8]},
            r"capability 8.9 or later \(this run: cpu\); drop it from "
            r"model.converters, or set quantize.linear.float8.emulate = true",
        ),
        (
            {
                "model.converters": [FLOAT8],
                f"{FLOAT8}.emulate": True,
                "compile.enable": True,
            },
            "emulates float8 in eager mode only; set compile.enable = false",
        ),
    ],
)
def test_what_the_device_cannot_run_is_refused_by_name(upstream, overrides, match):
    with pytest.raises(ConfigError, match=match):
        translate(overrides)


@pytest.mark.skipif(HAS_TORCHAO, reason="torchao is installed")
def test_without_torchao_the_line_says_what_to_install(upstream):
    with pytest.raises(ConfigError, match=f"'{FLOAT8}' runs upstream's torchao code"):
        translate({"model.converters": [FLOAT8], f"{FLOAT8}.emulate": True})


@requires_era("config_registry")
@pytest.mark.parametrize(
    "key, value, match",
    [
        (f"{FLOAT8}.emulat", True, r"no counterpart .*\(did you mean 'emulate'\?\)"),
        (f"{FLOAT8}.emulate", 1, "= 1: expected true or false"),
        (f"{FLOAT8}.model_compile_enabled", True, "takes .*'emulate'"),
        ("quantize.linear.float9.emulate", True, "did you mean 'quantize.linear"),
        # 0.2.x's field; 0.3.0's MX linears take the ones to convert (fqns)
        ("quantize.linear.mx.filter_fqns", ["output"], "takes .*'fqns'"),
    ],
)
def test_0_3_checks_quantize_keys_against_its_own_fields(upstream, key, value, match):
    with pytest.raises(ConfigError, match=match):
        translate({key: value})


@requires_era("config_registry")
@pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao (nox -s torchao)")
def test_0_3_builds_upstreams_converter_from_the_keys(upstream):
    from torchtitan.models.common.linear import Linear

    trainer = translate(
        {
            "model.converters": [FLOAT8],
            f"{FLOAT8}.emulate": True,
            f"{FLOAT8}.filter_fqns": ["lm_head"],  # 0.2.x's "output"
        }
    )
    kinds = {
        fqn: type(node).__qualname__
        for fqn, node, _, _ in trainer.model_spec.model.traverse(Linear.Config)
    }
    assert kinds["lm_head"] == "Linear.Config"  # filtered
    converted = [fqn for fqn, kind in kinds.items() if "Float8" in kind]
    assert len(converted) == len(kinds) - 1, kinds


@pytest.mark.e2e
@pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao (nox -s torchao)")
def test_emulated_float8_trains_from_the_same_keys_on_both_eras(tmp_path):
    dump = tmp_path / "run"
    scalars = train(
        dump,
        "--model.converters", FLOAT8,
        f"--{FLOAT8}.emulate", "true",
        steps=3,
    )  # fmt: skip
    losses = scalars[LOSS]
    assert losses[3] < losses[1], losses
    log = (dump.parent / "run.log").read_text()
    assert "Swapped to Float8Linear layers" in log


@requires_era("config_registry")
@pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao (nox -s torchao)")
def test_0_3_recipe_whose_converter_cannot_run_here_names_the_flavor(upstream):
    with pytest.raises(ConfigError, match="flavor '8b_mxfp8' cannot run here: MXFP8"):
        translate({"model.flavor": "8b_mxfp8"})


def test_doctor_says_which_run_on_this_device():
    from torchtitan_npu.converters.quantization import QUANTIZATIONS, availability_table

    rows = {line.split()[0]: line for line in availability_table("cpu").splitlines()}
    assert set(QUANTIZATIONS) <= set(rows)
    assert "emulated only (quantize.linear.float8.emulate = true)" in rows[FLOAT8]
    assert rows["quantize.linear.mx"].endswith(" no")
    assert ("pip install torchao" in rows[FLOAT8]) is not HAS_TORCHAO
