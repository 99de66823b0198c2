"""The parallel layouts of the matrix (world size <= 4) and where each runs."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KnownIssue:
    """An upstream bug the matrix reproduces: grad_norm is ``ratio`` x single's.

    The cell reports it (not a pass) as long as the ratio matches exactly what
    the bug predicts; any other mismatch is a failure.
    """

    grad_norm_ratio: float
    reason: str
    loss_rtol: float | None = None  # when the bug also moves the loss


_GLOBAL_TOKENS_022 = "0.2.2 normalizes the loss by the global token count, but "


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    overrides: dict[str, object] = field(default_factory=dict)
    # era or version -> why this layout cannot run there
    unsupported: dict[str, str] = field(default_factory=dict)
    # version -> an upstream bug this layout shows there
    known_issues: dict[str, KnownIssue] = field(default_factory=dict)
    # per-era overrides (e.g. a flex-attention flavor on 0.2.x for CP)
    era_overrides: dict[str, dict[str, object]] = field(default_factory=dict)
    # (loss, grad_norm) parity rtol of a model upstream computes partly in
    # bf16 (None: the fp32 tolerances); determinism and resume stay bitwise
    parity_rtol: tuple[float, float] | None = None

    @property
    def model(self) -> str:
        return str(self.overrides.get("model.name", "llama3"))

    def why_unsupported(self, *, version: str, era: str) -> str | None:
        return self.unsupported.get(version) or self.unsupported.get(era)

    def reference_args(self, era: str) -> list[str]:
        """The settings a single-device reference must share (data, model)."""
        merged = {**self.overrides, **self.era_overrides.get(era, {})}
        shared = {k: v for k, v in merged.items() if k in REFERENCE_KEYS}
        return [a for key, value in shared.items() for a in (f"--{key}", str(value))]

    def known_issue(self, version: str) -> KnownIssue | None:
        return self.known_issues.get(version)

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


def _pipeline(schedule: str, *, dp_shard: int = 1) -> dict:
    """A PP=2 layout's settings, and the 0.2.2 PP gradient-scale bug it shows."""
    tokens = 256 * dp_shard  # tokens per step: 2 x 128 per dp rank
    issue = KnownIssue(
        float(tokens),
        _GLOBAL_TOKENS_022 + "its pipeline schedule backpropagates the summed "
        f"microbatch losses before that division: gradients are {tokens}x "
        "(the tokens per step)",
    )
    return {
        "overrides": {
            **_degrees(pp=2, dp_shard=dp_shard),
            "parallelism.pipeline_parallel_schedule": schedule,
        },
        "known_issues": {"0.2.2": issue},
    }


# Settings that change what is computed, not how it is parallelized.
REFERENCE_KEYS = ("training.seq_len", "model.name", "model.flavor")

_CP_NEEDS_FLEX = "CP on CPU needs FlexAttention (SDPA has no CPU sharding strategy)"

LAYOUTS = [
    Layout("single", 1, _degrees()),
    Layout(
        "ddp",
        2,
        _degrees(dp_replicate=2),
        known_issues={
            "0.2.2": KnownIssue(
                0.5,
                _GLOBAL_TOKENS_022 + "its DDP (replicate) still averages "
                "gradients over ranks: they come out 1/dp of the right value",
                # AdamW's eps makes halved gradients visible: ~6.5e-5 by step 3
                loss_rtol=2e-4,
            )
        },
    ),
    Layout("fsdp", 2, _degrees(dp_shard=2)),
    Layout("hsdp", 4, _degrees(dp_replicate=2, dp_shard=2)),
    Layout("tp", 2, _degrees(tp=2)),
    Layout("fsdp_tp", 4, _degrees(dp_shard=2, tp=2)),
    Layout("pp_1f1b", 2, **_pipeline("1F1B")),
    Layout("pp_interleaved", 2, **_pipeline("Interleaved1F1B")),
    Layout("pp_gpipe", 2, **_pipeline("GPipe")),
    Layout("pp_fsdp", 4, **_pipeline("1F1B", dp_shard=2)),
    Layout(
        "cp",
        2,
        # FlexAttention CP builds the block mask per rank's shard and needs
        # whole 128-token blocks for each load-balanced half: 512 / 2 = 2 x 128.
        {**_degrees(cp=2), "training.seq_len": 512},
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

# titan-npu's injected Qwen2 (models/qwen2): the same checks, its own seed
# checkpoint and single-device reference. On 0.3.x it is built from upstream's
# decoder parts, so DDP, CP and the converters apply to it too.
_QWEN2 = {"model.name": "qwen2", "model.flavor": "debugmodel"}
_QWEN2_PP = _pipeline("1F1B")
_QWEN2_OWN_MODEL = {
    "trainspec": "0.2.x trains titan-npu's own Qwen2 module, with its own "
    "parallelize (FSDP, TP, PP, AC); DDP, CP and the converters apply to "
    "upstream's decoder parts (0.3.x)"
}
LAYOUTS += [
    Layout("qwen2_single", 1, {**_degrees(), **_QWEN2}),
    Layout("qwen2_fsdp", 2, {**_degrees(dp_shard=2), **_QWEN2}),
    Layout("qwen2_tp", 2, {**_degrees(tp=2), **_QWEN2}),
    Layout("qwen2_fsdp_tp", 4, {**_degrees(dp_shard=2, tp=2), **_QWEN2}),
    Layout(
        "qwen2_pp_1f1b",
        2,
        {**_QWEN2_PP["overrides"], **_QWEN2},
        known_issues=_QWEN2_PP["known_issues"],
    ),
    Layout(
        "qwen2_fsdp_ac_selective",
        2,
        {**_degrees(dp_shard=2), **_QWEN2, "activation_checkpoint.mode": "selective"},
    ),
    Layout(
        "qwen2_ddp",
        2,
        {**_degrees(dp_replicate=2), **_QWEN2},
        unsupported=_QWEN2_OWN_MODEL,
    ),
    Layout(
        "qwen2_cp",
        2,
        {**_degrees(cp=2), **_QWEN2, "training.seq_len": 512},
        unsupported=_QWEN2_OWN_MODEL,
    ),
    Layout(
        "qwen2_converters_fsdp",
        2,
        {
            **_degrees(dp_shard=2),
            **_QWEN2,
            "model.converters": "rms_norm,rope,attention,swiglu",
        },
        unsupported=_QWEN2_OWN_MODEL,
    ),
]

# Kernel converters (torchtitan_npu/converters) under sharding: checked against
# the unconverted single-device reference.
_CONVERTERS = {"model.converters": "rms_norm,rope,attention,swiglu"}
_CONVERTERS_PP = _pipeline("1F1B")
LAYOUTS += [
    Layout("converters_fsdp", 2, {**_degrees(dp_shard=2), **_CONVERTERS}),
    Layout("converters_fsdp_tp", 4, {**_degrees(dp_shard=2, tp=2), **_CONVERTERS}),
    Layout(
        "converters_pp_1f1b",
        2,
        {**_CONVERTERS_PP["overrides"], **_CONVERTERS},
        known_issues=_CONVERTERS_PP["known_issues"],
    ),
]

# A user's own HF checkpoint: a llama of no registered size (flavor ``hf``,
# derived from its config.json), converted from transformers' files and
# fine-tuned; its seed is that conversion (conftest.hf_checkpoint).
HF_FLAVOR = {"model.name": "llama3", "model.flavor": "hf"}
LAYOUTS += [Layout("hf_finetune", 2, {**_degrees(dp_shard=2), **HF_FLAVOR})]

# Upstream's other models through the overlay: single, fsdp and tp, each from
# its own seed checkpoint; the MoE models' ep rows run on gloo through the
# overlay's gloo_*_token_exchange on 0.3.x.
_ERAS = ("config_registry", "trainspec")
_NEW_IN_030 = "the model is new in upstream 0.3.0"
_KIMI_TP = (
    "upstream's Kimi optimizer (DistMuon) requires tensor_parallel_degree=1 "
    "(TP can give _StridedShard parameters it does not support)"
)
# gpt_oss's experts (GEMMs, SwiGLU, biases) are bf16 in upstream: FSDP parity
# measured 2.0e-4 (loss) / 1.4e-3 (grad_norm) over 4 steps. Under TP each rank
# also rounds its partial expert output to bf16 before the sum (layer 0's
# experts: 0.6% of their max off one device, tests/tp_experts.py): measured
# 1.3e-4 / 7.4e-4 at step 1, up to 7.5e-4 / 2.0e-2 by step 4 (2026-12-03).
# Under EP the experts see other token groupings: step 1 equal / 7.3e-5, by
# step 4 1.4e-4 / 1.4e-2 (2026-12-03).
_BF16_EXPERTS_RTOL = {"fsdp": (1e-3, 5e-3), "tp": (1e-3, 3e-2), "ep": (1e-3, 3e-2)}
# Top-k routing turns rounding into different choices: TP's partial sums move
# the router's scores by ~1e-5, which flips the few tokens whose k-th and
# (k+1)-th expert scores are closer than that (qwen3 debugmodel_moe, step 1:
# 38 of 65536 choices, first in layer 2 at gaps <= 4.8e-6); each flip changes
# the gradients, the next step's weights and so more choices (5453 by step 4).
# Measured in the matrix (loss / grad_norm): step 1 8.0e-7 / 2.5e-5, step 3
# 8.4e-5 / 8.0e-3, step 4 2.8e-5 / 1.3e-2 (0.3.0, 2026-12-03). FSDP flips the
# same way once its gradient reductions round (benchmarks/moe_routing.py on
# distinct rows: no choice moved at step 1, 225 at step 2); the matrix's FSDP
# ranks reduce two identical halves, which does not round.
_ROUTING_RTOL = {"tp": (3e-4, 3e-2)}
_SDPA_CPU_TP = (
    "0.2.x's qwen3 hands TP-sharded DTensors to SDPA, whose CPU flash kernel has "
    "no DTensor sharding strategy in torch 2.13 (measured on 0.2.2 2026-12-02, "
    "0.2.1 2026-12-03: NotImplementedError at step 1); CUDA/NPU kernels have one"
)
_EP_UNSUPPORTED = {
    "0.2.1": "upstream 0.2.1 asks for the TP mesh whenever EP is on "
    "(parallelize_llama: parallel_dims.get_mesh('tp'), 'Mesh tp is not "
    "available' without TP; measured 2026-12-03); 0.2.2 asks for it optionally",
}
OTHER_MODELS = {
    # row prefix: (model, flavor, MoE, unsupported, tp unsupported (everywhere,
    # or per era / version), parity rtol per layout where not the fp32 one)
    "gpt_oss": (
        "gpt_oss",
        "debugmodel",
        True,
        {
            "0.2.1": "0.2.1's gpt_oss is an experiment whose RoPE ignores its YaRN "
            "arguments: titan-npu refuses it by name",
            "0.2.0": "upstream 0.2.0 has no gpt_oss",
        },
        None,
        _BF16_EXPERTS_RTOL,
    ),
    # the model registry's name, on both eras (0.3.x's config function: moe_debug)
    "qwen3_moe": (
        "qwen3",
        "debugmodel_moe",
        True,
        {},
        {"trainspec": _SDPA_CPU_TP},
        _ROUTING_RTOL,
    ),
    "llama4": (
        "llama4",
        "debugmodel",
        True,
        {"config_registry": "upstream 0.3.0 has no llama4"},
        None,
        {},
    ),
    "qwen3_5": ("qwen3_5", "debugmodel", False, {"trainspec": _NEW_IN_030}, None, {}),
    "kimi": (
        "kimi_k2_7",
        "kimi_k2_5_debugmodel",
        True,
        {"trainspec": _NEW_IN_030},
        _KIMI_TP,
        {},
    ),
}
for prefix, (model, flavor, moe, unsupported, no_tp, rtol) in OTHER_MODELS.items():
    chosen = {"model.name": model, "model.flavor": flavor}
    tp_unsupported = dict(unsupported)
    if no_tp:
        tp_unsupported |= (
            no_tp if isinstance(no_tp, dict) else dict.fromkeys(_ERAS, no_tp)
        )
    LAYOUTS += [
        Layout(f"{prefix}_single", 1, {**_degrees(), **chosen}, unsupported),
        Layout(
            f"{prefix}_fsdp",
            2,
            {**_degrees(dp_shard=2), **chosen},
            unsupported,
            parity_rtol=rtol.get("fsdp"),
        ),
        Layout(
            f"{prefix}_tp",
            2,
            {**_degrees(tp=2), **chosen},
            tp_unsupported,
            parity_rtol=rtol.get("tp"),
        ),
    ]
    if moe:
        ep = {**_degrees(dp_shard=2), "parallelism.expert_parallel_degree": 2}
        # the model's own reasons first (a model new in 0.3.0 says so)
        ep_unsupported = {**_EP_UNSUPPORTED, **unsupported}
        if "trainspec" in unsupported:
            ep_unsupported = unsupported
        LAYOUTS.append(
            Layout(
                f"{prefix}_ep",
                2,
                {**ep, **chosen},
                ep_unsupported,
                parity_rtol=rtol.get("ep"),
            )
        )

BY_NAME = {layout.name: layout for layout in LAYOUTS}


@dataclass(frozen=True)
class ResumeAcross:
    """A checkpoint saved under layout `saved`, resumed under `resumed`."""

    saved: Layout
    resumed: Layout

    @property
    def name(self) -> str:
        return f"resume_{self.saved.name}_to_{self.resumed.name}"

    @property
    def nproc(self) -> int:
        return self.resumed.nproc

    def why_unsupported(self, *, version: str, era: str) -> str | None:
        for layout in (self.saved, self.resumed):
            reason = layout.why_unsupported(version=version, era=era)
            if reason or layout.known_issue(version):
                return f"{layout.name}: {reason or layout.known_issue(version).reason}"
        return None


def dp_degree(layout: Layout) -> int:
    """The layout's data-parallel degree (replicate x shard)."""
    o = layout.overrides
    return int(o["parallelism.data_parallel_replicate_degree"]) * int(
        o["parallelism.data_parallel_shard_degree"]
    )


RESUMES = [
    ResumeAcross(BY_NAME[a], BY_NAME[b])
    for a, b in [
        ("fsdp", "single"),
        ("fsdp", "tp"),
        ("fsdp", "fsdp_tp"),
        ("pp_1f1b", "fsdp"),
        ("hsdp", "fsdp"),
    ]
]
RESUME_BY_NAME = {r.name: r for r in RESUMES}
