"""The in-training bridge: an upstream ``StateDictAdapter`` (either era) made
from a titan-npu mapping, for ``checkpoint.initial_load_in_hf`` and
``checkpoint.last_save_in_hf``. The overlay registers it on the model specs.

Training state dicts hold DTensors (FSDP2 / TP). Per-tensor transforms are
view ops DTensor propagates; stacked experts and fused parts are gathered to
full tensors for their HF keys and re-sharded to their original placements on
load.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters import get_adapter
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.mapping import ConversionError, Rule

_CLASSES: dict[tuple[str, str], type] = {}


def adapter_class(model: str, era: Era) -> type:
    """The upstream adapter class for `model` (cached: one class per model)."""
    if (model, era) not in _CLASSES:
        _CLASSES[model, era] = _make_class(model, era)
    return _CLASSES[model, era]


def with_adapter(spec: Any, model: str, era: Era) -> Any:
    """An upstream TrainSpec / ModelSpec with titan-npu's adapter for ``model``
    (and, for a 0.2.x TrainSpec, the flavors derived from config.json in this
    process: ``architecture.register``)."""
    import dataclasses

    from torchtitan_npu.state_dict_adapters.architecture import runtime_flavors

    spec = dataclasses.replace(spec, state_dict_adapter=adapter_class(model, era))
    derived = runtime_flavors(model, era)
    if derived and hasattr(spec, "model_args"):  # a TrainSpec
        spec = dataclasses.replace(spec, model_args={**spec.model_args, **derived})
    return spec


def _make_class(model: str, era: Era) -> type:
    from torch.distributed.tensor import DTensor, Replicate
    from torchtitan.protocols.state_dict_adapter import StateDictAdapter

    spec = get_adapter(model)

    class TitanNpuStateDictAdapter(StateDictAdapter):
        def __init__(self, model_args: Any, hf_assets_path: str | None):
            super().__init__(model_args, hf_assets_path)
            self.model_args = model_args
            self.layout, self.tied = um.describe(model, model_args, era)
            self.hf_config = spec.hf_config(model_args, era, self.layout)
            self.hf_config["tie_word_embeddings"] = self.tied
            self.keymap = spec.keymap(era, self.hf_config)
            self.placements: dict[str, tuple] = {}  # gathered DTensor -> layout
            self.tied_keys: dict[str, str] = {}  # native tied -> native source

        def _full(self, key: str, value: Any) -> torch.Tensor:
            """A stacked or fused tensor whole (its DTensor layout kept)."""
            if isinstance(value, DTensor):
                self.placements[key] = (value.device_mesh, value.placements)
                value = value.full_tensor()
            return value

        def _placed(self, key: str, value: torch.Tensor) -> Any:
            """`value` laid out as `_full` found `key`."""
            if key not in self.placements:
                return value
            mesh, placements = self.placements[key]
            replicated = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim)
            return replicated.redistribute(mesh, placements)

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            hf: dict[str, Any] = {}
            fused: dict[str, tuple[Rule, dict[str, torch.Tensor]]] = {}
            for key, value in state_dict.items():
                found = self.keymap.match_native(key)
                if found is None:
                    raise ConversionError(f"{model} to_hf", [f"no rule for {key!r}"])
                rule, fields = found
                if rule.hf is None:  # native-only: no HF counterpart
                    continue
                if rule.tied_to and self.tied:
                    tied = self.keymap.match_hf(rule.tied_to)
                    assert tied is not None and tied[0].native, rule.tied_to
                    self.tied_keys[key] = tied[0].native
                    continue
                if rule.fused is not None:
                    part = fields.pop("part")
                    parts = fused.setdefault(rule.hf.format(**fields), (rule, {}))[1]
                    parts[part] = self._full(key, value)
                elif rule.stacked:
                    value = self._full(key, value)
                    for expert, part in enumerate(value.unbind(0)):
                        hf[rule.hf.format(expert=expert, **fields)] = part
                else:
                    hf[rule.hf.format(**fields)] = rule.transform.to_hf(value)
            for hf_key, (rule, parts) in fused.items():
                assert rule.fused is not None
                ordered = [parts[p] for p in rule.fused.parts]
                hf[hf_key] = torch.cat(ordered, rule.fused.dim)
            return hf

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            native: dict[str, Any] = {}
            experts: dict[str, dict[int, torch.Tensor]] = {}
            for key, value in hf_state_dict.items():
                found = self.keymap.match_hf(key)
                if found is None:
                    raise ConversionError(f"{model} from_hf", [f"no rule for {key!r}"])
                rule, fields = found
                if rule.native is None:
                    continue
                if rule.fused is not None:
                    names = [
                        rule.native.format(part=p, **fields) for p in rule.fused.parts
                    ]
                    sizes = [self.layout[n].shape[rule.fused.dim] for n in names]
                    parts = value.split(sizes, rule.fused.dim)
                    for name, part in zip(names, parts):
                        native[name] = self._placed(name, part.contiguous())
                elif rule.stacked:
                    target = rule.native.format(**fields)
                    experts.setdefault(target, {})[int(fields["expert"])] = value
                else:
                    native[rule.native.format(**fields)] = rule.transform.from_hf(value)
            for target, parts in experts.items():
                stacked = torch.stack([parts[e] for e in sorted(parts)])
                native[target] = self._placed(target, stacked)
            for tied, source in self.tied_keys.items():
                if source in native:
                    native[tied] = native[source]
            return native

    TitanNpuStateDictAdapter.__name__ = f"TitanNpu{model.title()}StateDictAdapter"
    TitanNpuStateDictAdapter.__qualname__ = TitanNpuStateDictAdapter.__name__
    return TitanNpuStateDictAdapter
