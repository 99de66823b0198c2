"""The parallel layouts of the matrix (world size <= 4) and where each runs."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    overrides: dict[str, object] = field(default_factory=dict)
    # era or version -> why this layout cannot run there
    unsupported: dict[str, str] = field(default_factory=dict)
    # per-era overrides (e.g. a flex-attention flavor on 0.2.x for CP)
    era_overrides: dict[str, dict[str, object]] = field(default_factory=dict)

    def why_unsupported(self, *, version: str, era: str) -> str | None:
        return self.unsupported.get(version) or self.unsupported.get(era)

    def args(self, era: str) -> list[str]:
        merged = {**self.overrides, **self.era_overrides.get(era, {})}
        return [a for key, value in merged.items() for a in (f"--{key}", str(value))]


def _degrees(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1) -> dict[str, object]:
    return {
        "parallelism.data_parallel_replicate_degree": dp_replicate,
        "parallelism.data_parallel_shard_degree": dp_shard,
        "parallelism.tensor_parallel_degree": tp,
        "parallelism.pipeline_parallel_degree": pp,
        "parallelism.context_parallel_degree": cp,
    }


_CP_NEEDS_FLEX = "CP on CPU needs FlexAttention (SDPA has no CPU sharding strategy)"

LAYOUTS = [
    Layout("single", 1, _degrees()),
    Layout("ddp", 2, _degrees(dp_replicate=2)),
    Layout("fsdp", 2, _degrees(dp_shard=2)),
    Layout("hsdp", 4, _degrees(dp_replicate=2, dp_shard=2)),
    Layout("tp", 2, _degrees(tp=2)),
    Layout("fsdp_tp", 4, _degrees(dp_shard=2, tp=2)),
    Layout(
        "pp_1f1b",
        2,
        {**_degrees(pp=2), "parallelism.pipeline_parallel_schedule": "1F1B"},
    ),
    Layout(
        "pp_interleaved",
        2,
        {
            **_degrees(pp=2),
            "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
        },
    ),
    Layout(
        "pp_gpipe",
        2,
        {**_degrees(pp=2), "parallelism.pipeline_parallel_schedule": "GPipe"},
    ),
    Layout(
        "pp_fsdp",
        4,
        {
            **_degrees(pp=2, dp_shard=2),
            "parallelism.pipeline_parallel_schedule": "1F1B",
        },
    ),
    Layout(
        "cp",
        2,
        _degrees(cp=2),
        unsupported={
            "0.2.0": "upstream 0.2.0 refuses FlexAttention with CP; " + _CP_NEEDS_FLEX,
            "0.2.1": "upstream 0.2.1 refuses FlexAttention with CP; " + _CP_NEEDS_FLEX,
        },
        era_overrides={"trainspec": {"model.flavor": "debugmodel_flex_attn"}},
    ),
    Layout(
        "fsdp_ac_full",
        2,
        {**_degrees(dp_shard=2), "activation_checkpoint.mode": "full"},
    ),
    Layout(
        "fsdp_ac_selective",
        2,
        {**_degrees(dp_shard=2), "activation_checkpoint.mode": "selective"},
    ),
]

BY_NAME = {layout.name: layout for layout in LAYOUTS}
