"""Train-config parsing and its translation to each upstream era."""

import json
from pathlib import Path

import pytest
from support import requires_era

from torchtitan_npu.config import DEFAULT_CONFIG, ConfigError, resolve
from torchtitan_npu.config.schema import load_toml, parse_overrides


def test_overrides_parse_toml_literals_flags_and_strings():
    assert parse_overrides(
        [
            "--training.steps",
            "5",
            "--optimizer.lr=3e-4",
            "--checkpoint.enable",
            "--job.dump_folder",
            "out/run",
            "--parallelism.fsdp-reshard-after-forward",
            "never",
        ]
    ) == {
        "training.steps": 5,
        "optimizer.lr": 3e-4,
        "checkpoint.enable": True,
        "job.dump_folder": "out/run",
        "parallelism.fsdp_reshard_after_forward": "never",
    }


@pytest.mark.parametrize("bad", [["steps", "5"], ["--steps", "5"]])
def test_malformed_override_is_an_error(bad):
    with pytest.raises(ConfigError, match="--section.key"):
        parse_overrides(bad)


def test_resolve_fills_embedded_assets_and_applies_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path))
    config = resolve(None, ["--training.steps", "3"])
    assert config["training"]["steps"] == 3
    assert config["training"]["dataset"] == "c4_test"
    assert (tmp_path / config["training"]["dataset_path"] / "data.jsonl").exists()
    assert (tmp_path / config["model"]["hf_assets_path"] / "tokenizer.json").exists()


def test_validation_on_the_embedded_corpus_reads_its_held_out_part(
    tmp_path, monkeypatch
):
    """Not upstream's default c4_validation (a download), and none of the
    records training reads."""
    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path))
    config = resolve(None, ["--validation.enable", "true"])
    validation, training = config["validation"], config["training"]
    assert validation["dataset"] == "c4_test"
    held_out = Path(validation["dataset_path"]) / "data.jsonl"
    corpus = Path(training["dataset_path"]) / "data.jsonl"
    texts = {json.loads(line)["text"] for line in held_out.read_text().splitlines()}
    seen = {json.loads(line)["text"] for line in corpus.read_text().splitlines()}
    assert len(texts) > 100 and not texts & seen
    assert resolve(None, ["--validation.dataset", "embedded"])["validation"] == {
        "dataset": "c4_test",
        "dataset_path": validation["dataset_path"],
    }
    data = tmp_path / "data"
    data.mkdir()
    own = ["--validation.enable", "true", "--validation.dataset_path", str(data)]
    assert resolve(None, own)["validation"] == {
        "enable": True,
        "dataset_path": str(data),
    }
    own[1:2] = ["true", "--validation.dataset", "embedded"]
    with pytest.raises(ConfigError, match="validation.dataset_path is set but"):
        resolve(None, own)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory; pass a TOML file"):
        load_toml(tmp_path)
    (tmp_path / "latin1.toml").write_bytes(b"# \xe9t\xe9\n")
    with pytest.raises(ConfigError, match="latin1.toml cannot be read: 'utf-8' codec"):
        load_toml(tmp_path / "latin1.toml")


def test_a_config_without_a_model_trains_upstreams_default(tmp_path, monkeypatch):
    """0.2.x's JobConfig defaults (llama3 debugmodel), on every era."""
    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path))
    (tmp_path / "mine.toml").write_text("[training]\nsteps = 3\n")
    model = resolve(tmp_path / "mine.toml", [])["model"]
    assert (model["name"], model["flavor"]) == ("llama3", "debugmodel")


@requires_era("config_registry")
def test_config_registry_translation(upstream, tmp_path):
    from torchtitan.distributed.activation_checkpoint import FullAC

    from torchtitan_npu.config import batch_and_data
    from torchtitan_npu.config.config_registry import translate

    config = resolve(None, ["--training.dataset", "c4_test"])
    config["training"]["dataset_path"] = str(tmp_path)
    config["activation_checkpoint"]["mode"] = "full"
    config["optimizer"]["lr"] = 1e-3
    trainer = translate(config, version=upstream.installed.version, device_type="cpu")
    assert trainer.training.steps == config["training"]["steps"]
    loader = trainer.dataloader
    if batch_and_data.grain_loader(loader):  # upstream main: a dataset config
        assert batch_and_data.inner_dataset(loader.dataset).source.path == str(tmp_path)
    else:
        assert loader.dataset_path == str(tmp_path)
    assert trainer.dump_folder == config["job"]["dump_folder"]
    assert trainer.debug.seed == 42 and trainer.debug.deterministic is True
    assert isinstance(trainer.activation_checkpoint, FullAC.Config)
    assert trainer.optimizer.param_groups[0].optimizer_kwargs["lr"] == 1e-3
    assert trainer.model_spec.name == "llama3"
    assert trainer.model_spec.flavor == "debugmodel"
    assert trainer.training.disable_cuda_graphs is True  # no CUDA graphs off CUDA


@requires_era("config_registry")
@pytest.mark.parametrize(
    "key, value, match",
    [
        ("training.bogus", 1, "'training.bogus' has no counterpart"),
        ("optimizer.lrr", 1.0, "(did you mean 'optimizer.lr'?)"),
        ("profiling.enable_profilin", True, "'profiling.enable_profiling'"),
        ("model.flavor", "huge", "no flavor 'huge'"),
        ("model.name", "nonesuch", "unknown model 'nonesuch'"),
    ],
)
def test_config_registry_rejects_what_it_cannot_honour(upstream, key, value, match):
    from torchtitan_npu.config.config_registry import translate
    from torchtitan_npu.config.schema import apply_overrides

    config = load_toml(DEFAULT_CONFIG)
    apply_overrides(config, {key: value})
    with pytest.raises(ConfigError, match=match) as info:
        translate(config, version=upstream.installed.version, device_type="cpu")
    assert "config_registry" in str(info.value)


@requires_era("config_registry")
@pytest.mark.parametrize(
    "mode, option, wrapped",
    [
        ("selective", 2, [False, True, False, True]),  # 0.2.x's every-nth layer
        ("selective", "0", [True] * 4),
        ("selective", "op", None),  # 0.3's own per-op policy
        ("full", 2, None),  # the option is for selective AC only, as on 0.2.x
    ],
)
def test_selective_ac_option_keeps_its_0_2_meaning(upstream, mode, option, wrapped):
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
    )
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from torchtitan_npu.config.config_registry import translate
    from torchtitan_npu.distributed.activation_checkpoint import LayerAC

    config = resolve(None, [])
    config["activation_checkpoint"] = {"mode": mode, "selective_ac_option": option}
    ac = translate(
        config, version=upstream.installed.version, device_type="cpu"
    ).activation_checkpoint
    if wrapped is None:
        want = SelectiveAC.Config if mode == "selective" else FullAC.Config
        assert type(ac) is want
        return
    assert isinstance(ac, LayerAC.Config)
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(4)})
    ac.build().apply(model)
    got = [isinstance(block, CheckpointWrapper) for block in model.layers.values()]
    assert got == wrapped


def test_a_number_given_for_a_text_field_is_its_text():
    """`--activation_checkpoint.selective_ac_option 2` (0.2.x: a str field)."""
    from torchtitan_npu.config.fields import expected, fitted

    assert fitted(str, 2) == "2" and fitted(str | None, 0.5) == "0.5"
    assert fitted(int, 2) == 2 and fitted(float | str, 2) == 2
    assert fitted(str, True) is True and expected(str, fitted(bool, 1)) == "a string"


@requires_era("config_registry")
def test_the_optimizer_names_are_upstreams(upstream):
    from torchtitan.components.optimizer import OptimizersContainer

    from torchtitan_npu.config.config_registry import OPTIMIZERS

    for name in OPTIMIZERS:
        assert callable(OptimizersContainer._resolve_optimizer_factory(name))
    with pytest.raises(NotImplementedError, match="Optimizer SGD not added"):
        OptimizersContainer._resolve_optimizer_factory("SGD")


@requires_era("trainspec")
def test_the_optimizer_names_are_upstreams_0_2(upstream):
    from torch import nn
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig

    from torchtitan_npu.config.trainspec import OPTIMIZERS

    config = JobConfig().optimizer
    for name in OPTIMIZERS:
        config.name = name
        assert build_optimizers([nn.Linear(2, 2)], config, None)  # pyrefly: ignore
    config.name = "SGD"
    with pytest.raises(NotImplementedError, match="Optimizer SGD not added"):
        build_optimizers([nn.Linear(2, 2)], config, None)  # pyrefly: ignore


@requires_era("trainspec")
def test_trainspec_translation(upstream):
    from torchtitan.config import JobConfig

    from torchtitan_npu.config.fields import has_path
    from torchtitan_npu.config.trainspec import translate

    job = translate(load_toml(DEFAULT_CONFIG), version=upstream.installed.version)
    assert job["training"]["steps"] == load_toml(DEFAULT_CONFIG)["training"]["steps"]
    # 0.2.2 has [debug]; 0.2.0 and 0.2.1 keep the seed under [training].
    seed_section = "debug" if has_path(JobConfig(), "debug.seed") else "training"
    assert job[seed_section]["seed"] == 42
    assert job[seed_section]["deterministic"] is True


@requires_era("trainspec")
def test_trainspec_rejects_unknown_keys(upstream):
    from torchtitan_npu.config.trainspec import translate

    config = load_toml(DEFAULT_CONFIG)
    config["parallelism"]["bogus_degree"] = 2
    with pytest.raises(ConfigError, match="'parallelism.bogus_degree'.*trainspec"):
        translate(config, version=upstream.installed.version)
    config = load_toml(DEFAULT_CONFIG)
    config.setdefault("debug", {})["seeed"] = 2
    with pytest.raises(ConfigError, match=r"did you mean '(debug|training)\.seed'"):
        translate(config, version=upstream.installed.version)


def test_resolve_normalizes_and_the_checks_only_read(tmp_path, monkeypatch):
    """resolve() makes paths absolute; preflight's checks change nothing."""
    import copy

    from torchtitan_npu.config import preflight

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    own = ["--training.dataset", "c4_test", "--training.dataset_path"]
    config = resolve(None, [*own, "data"])
    assert config["training"]["dataset_path"] == str(tmp_path / "data")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(None, [*own, "nowhere"])
    config = resolve(None, [])
    before = copy.deepcopy(config)
    preflight.check(config, world_size=1, launch="1 x 1")
    assert config == before


@requires_era("config_registry")
@pytest.mark.parametrize("pp", [1, 2])
def test_the_projects_batch_keys_mean_the_same_tokens_on_every_shape(upstream, pp):
    """training.local_batch_size x seq_len per DP rank, split into PP
    microbatches, global_batch_size sequences a step: read back from the
    Trainer.Config as 0.3.0 holds them or as main's token counts."""
    from torchtitan_npu.config import batch_and_data
    from torchtitan_npu.config.config_registry import translate

    batch = {
        "training.seq_len": 64,
        "training.local_batch_size": 4,
        "training.global_batch_size": 8,
        "parallelism.pipeline_parallel_microbatch_size": 2 if pp > 1 else 1,
    }
    overrides = [f"--{key}={value}" for key, value in batch.items()]
    overrides += [f"--parallelism.pipeline_parallel_degree={pp}"]
    config = resolve(None, overrides)
    trainer = translate(config, version=upstream.installed.version, device_type="cpu")
    got = batch_and_data.sequence_batch(trainer)
    if pp == 1:  # no microbatches: one forward takes the local batch
        got["parallelism.pipeline_parallel_microbatch_size"] = 1
    assert got == batch
    if batch_and_data.counts_tokens():
        training = trainer.training
        assert training.max_context_length == 64
        assert training.num_tokens_per_microbatch_per_dp_rank == 64 * (
            2 if pp > 1 else 4
        )
        assert training.num_tokens_per_train_step == 8 * 64
        if pp > 1:
            assert trainer.parallelism.num_pp_microbatches == 2


@requires_era("config_registry")
def test_upstreams_own_token_counts_and_the_projects_keys_are_not_mixed(upstream):
    from torchtitan_npu.config import batch_and_data
    from torchtitan_npu.config.config_registry import translate

    if not batch_and_data.counts_tokens():
        pytest.skip("this upstream has no token-count batch fields")
    config = resolve(None, ["--training.seq_len=64"])
    config["training"]["num_tokens_per_train_step"] = 4096
    with pytest.raises(ConfigError, match="both set the batch"):
        translate(config, version=upstream.installed.version, device_type="cpu")
