"""``titan-npu checkpoint migrate``: a native (DCP) training checkpoint of one
upstream era in the native names of another, optimizer and training state
included, so a run resumes after an upgrade.

Model tensors go native(from) -> HF -> native(to) through the model's
declarative mapping (`convert`'s rules, both eras'). The optimizer's state is
keyed by parameter, and a parameter is not always a state-dict tensor: 0.3
fuses attention's q/k/v into one ``qkv_linear.wqkv`` parameter (upstream's
``FusedQKVLinear``; its state dict splits it back into wq/wk/wv), so AdamW's
moments are split and fused in upstream's layout (per kv group: the group's
q heads, then its k and v head). The migration runs under the upstream it
migrates to and builds that model on the meta device to learn its parameters.

Training state: the step, the token count and the hyper-parameters are kept;
the lr scheduler is written as the target era saves it; the data position of
each data-parallel rank (the sample it reached) is kept, while the packing
buffer (tokens of a partly used sample; the eras pack differently) is
emptied: no sample is repeated, the rest of that one sample is skipped.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.compat.lock import read_lock
from torchtitan_npu.state_dict_adapters import (
    _NAMES_ONLY,
    architecture,
    get_adapter,
    native_era,
)
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.convert import (
    PROVENANCE,
    Progress,
    Result,
    _provenance,
    atomic_dir,
    check_out,
    current_era,
    read_json_file,
    run_config,
)
from torchtitan_npu.state_dict_adapters.mapping import (
    ConversionError,
    Group,
    TensorInfo,
    compare_layouts,
)
from torchtitan_npu.state_dict_adapters.native_io import NativeCheckpoint, write_native

STATE, GROUPS = "optimizer.state.", "optimizer.param_groups."
QKV = ("wq", "wk", "wv")  # the state-dict tensors of a fused wqkv parameter
# The packing buffers of each era's text dataset (emptied by a migration).
PACKING_BUFFERS = {
    Era.TRAINSPEC: ("token_buffer",),
    Era.CONFIG_REGISTRY: ("inputs_buffer", "labels_buffer", "positions_buffer"),
}

Make = Callable[[], torch.Tensor]


@dataclass
class Migration(Result):
    source_era: Era
    data: str  # what became of the data position, for the user
    model_only: bool  # no optimizer state in the source (a model-only save)


def migrate(
    source: str | Path, out: str | Path, to_version: str, *, progress: bool = True
) -> Migration:
    """SRC (a DCP checkpoint of a locked upstream) -> OUT in `to_version`'s
    native names; runs under that upstream."""
    what = f"checkpoint migrate {source}"
    target = _era_to(to_version, what)
    check_out(out)  # before any planning
    checkpoint = NativeCheckpoint(source)
    era = native_era(checkpoint.model_layout)
    if era is None:
        raise ConversionError(
            what, ["its parameter names are of no locked upstream era"]
        )
    if era == target:
        raise ConversionError(
            what, [f"it already has torchtitan {to_version}'s names (era {era})"]
        )
    model, flavor, module = _target_model(Path(source), target, what)
    plan = _Plan(checkpoint, model, era, target, module, what)
    objects, data = _training_state(checkpoint, plan, era, target)
    bar = Progress("migrate", sum(i.nbytes for i in plan.layout.values()), progress)
    start = time.perf_counter()

    def make(key: str) -> torch.Tensor:
        tensor = plan.makers[key]().contiguous()
        bar.advance(tensor.nbytes)
        return tensor

    with atomic_dir(out) as tmp, bar:
        write_native(tmp, plan.layout, make, objects)
        _provenance(tmp, model, flavor, target.value, source, migrated_from=era.value)
    seconds = time.perf_counter() - start
    model_only = not any(k.startswith(STATE) for k in plan.layout)
    return Migration(
        Path(out), flavor, len(plan.layout), bar.total, seconds, era, data, model_only
    )


def _era_to(version: str, what: str) -> Era:
    """The era of `--to VERSION`, which must be the installed one's."""
    entries = {e.version: Era(e.era) for e in read_lock()}
    if version not in entries:
        known = ", ".join(entries)
        raise ConversionError(
            what, [f"--to {version}: not a locked upstream ({known})"]
        )
    installed = current_era()
    if entries[version] != installed:
        raise ConversionError(
            what,
            [
                f"--to {version} is era {entries[version]}, the installed upstream "
                f"is era {installed}: run the migration with torchtitan {version} "
                "installed (it builds that model to learn its parameters)"
            ],
        )
    return installed


def _target_model(path: Path, era: Era, what: str) -> tuple[str, str, torch.nn.Module]:
    """(model, flavor, the model on meta) from the run's config or provenance."""
    recorded: dict = {}
    if (path / PROVENANCE).is_file():
        record = read_json_file(path / PROVENANCE)
        recorded = {"name": record.get("model"), "flavor": record.get("flavor")}
    elif (run := run_config(path)) is not None:
        recorded = run[1].get("model", {})
    name, flavor = recorded.get("name"), recorded.get("flavor")
    if not name or not flavor:
        raise ConversionError(
            what, ["no run config (titan_npu_config.json) records its model"]
        )
    get_adapter(name)  # a model with a mapping
    if flavor == architecture.HF_FLAVOR:
        hf_dir = recorded.get("hf_assets_path", "")
        args = architecture.derive(name, architecture.read_config(hf_dir), era)
    else:
        args = um.model_args(name, flavor, era)
    return name, flavor, um.build_meta(name, args, era)


class _Plan:
    """Every tensor of OUT: its name, metadata and how it is made."""

    def __init__(self, checkpoint, model, era, target, module, what):
        self.checkpoint, self.module = checkpoint, module
        self.layout: dict[str, TensorInfo] = {}
        self.makers: dict[str, Make] = {}
        source = checkpoint.model_layout
        self.renames = _renames(model, era, target, source)
        self.old_of = {new: old for old, (new, _) in self.renames.items()}
        want = um.layout_of(module)
        got = {new: source[old] for old, (new, _) in self.renames.items()}
        problems = compare_layouts(got, want, f"torchtitan {target} model")
        if problems:
            raise ConversionError(f"{what}: another model or flavor", problems)
        for key, (new, convert) in self.renames.items():
            self.add(new, source[key], _then(_reader(checkpoint, key), convert))
        self.source_param = _parameters_of(checkpoint, what)
        params = {n: TensorInfo.of(p) for n, p in module.named_parameters()}
        self.target_params: dict[str, str] = {}  # target parameter -> source one
        for param, info in params.items():
            parts = _parts(param, want)
            if parts is None:
                raise ConversionError(what, [f"{param}: not in the model's state dict"])
            self.target_params[param] = self.source_param[self.old_of[parts[0]]]
            self._plan_state(param, parts, info)

    def add(self, key: str, info: TensorInfo, make: Make) -> None:
        self.layout[key], self.makers[key] = info, make

    def _plan_state(self, param: str, parts: list[str], info: TensorInfo) -> None:
        """AdamW's moments (shaped like the parameter) and its scalar `step`."""
        prefix = f"{STATE}{self.target_params[param]}."
        for key, stored in self.checkpoint.layout.items():
            field = key.removeprefix(prefix)
            if not key.startswith(prefix) or "." in field:
                continue
            new = f"{STATE}{param}.{field}"
            if stored.shape == ():
                self.add(new, stored, _reader(self.checkpoint, key))
            else:
                moment = TensorInfo(info.shape, stored.dtype)
                self.add(new, moment, self._moment(param, parts, field))

    def _moment(self, param: str, parts: list[str], field: str) -> Make:
        """Each state-dict part's source moment (split out of a fused source
        parameter), renamed, and fused again if `param` is fused."""
        makers = []
        for part in parts:
            old = self.old_of[part]
            source_param = self.source_param[old]
            read = _reader(self.checkpoint, f"{STATE}{source_param}.{field}")
            source_parts = _parts(source_param, self.checkpoint.model_layout)
            if source_parts != [old]:  # a fused source parameter
                assert source_parts is not None  # checked by _parameters_of
                rows = [self.checkpoint.model_layout[p].shape[0] for p in source_parts]
                head_dim = _head_dim(self.module, part)
                index = source_parts.index(old)
                read = _split_part(read, rows, head_dim, index)
            makers.append(_then(read, self.renames[old][1]))
        if len(parts) == 1:
            return makers[0]
        head_dim = _head_dim(self.module, param)
        return lambda: fuse_qkv([m() for m in makers], head_dim)


def _parts(param: str, keys) -> list[str] | None:
    """The state-dict tensors of a parameter: itself, or a fused ``wqkv``'s
    wq/wk/wv; None if neither is in `keys`."""
    if param in keys:
        return [param]
    module, _, name = param.rpartition(".")
    if module.endswith(".wqkv"):
        parts = [f"{module.removesuffix('wqkv')}{w}.{name}" for w in QKV]
        if all(p in keys for p in parts):
            return parts
    return None


def _parameters_of(checkpoint: NativeCheckpoint, what: str) -> dict[str, str]:
    """Source model tensor -> the parameter its optimizer state is keyed by."""
    found = {k: k for k in checkpoint.model_layout}
    for key in checkpoint.layout:
        param = key.removeprefix(STATE).rpartition(".")[0]
        if not key.startswith(STATE) or param in checkpoint.model_layout:
            continue
        parts = _parts(param, checkpoint.model_layout)
        if parts is None:
            raise ConversionError(what, [f"{key}: of no model tensor"])
        found |= dict.fromkeys(parts, param)
    return found


def _head_dim(module: torch.nn.Module, name: str) -> int:
    """The head dim of the attention that holds tensor `name`."""
    path = name.split(".")[:-1]
    while path:
        head_dim = getattr(module.get_submodule(".".join(path)), "head_dim", None)
        if isinstance(head_dim, int):
            return head_dim
        path.pop()
    raise ConversionError(name, ["no attention module with a head_dim holds it"])


def fuse_qkv(tensors: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """wq, wk, wv (or their moments) -> upstream's fused wqkv layout: per kv
    group its heads_per_kv q heads, then its k head and v head."""
    q, k, v = tensors
    n_kv, tail = k.shape[0] // head_dim, tuple(q.shape[1:])
    per_kv = q.shape[0] // k.shape[0]
    grouped = [
        q.reshape(n_kv, per_kv, head_dim, *tail),
        k.reshape(n_kv, 1, head_dim, *tail),
        v.reshape(n_kv, 1, head_dim, *tail),
    ]
    return torch.cat(grouped, dim=1).reshape(-1, *tail)


def split_qkv(
    fused: torch.Tensor, rows: list[int], head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: (wq, wk, wv) of `rows` rows each."""
    q_rows, k_rows, _ = rows
    n_kv, per_kv, tail = k_rows // head_dim, q_rows // k_rows, tuple(fused.shape[1:])
    grouped = fused.reshape(n_kv, per_kv + 2, head_dim, *tail)
    return (
        grouped[:, :per_kv].reshape(q_rows, *tail),
        grouped[:, per_kv].reshape(k_rows, *tail),
        grouped[:, per_kv + 1].reshape(k_rows, *tail),
    )


def _split_part(read: Make, rows: list[int], head_dim: int, index: int) -> Make:
    return lambda: split_qkv(read(), rows, head_dim)[index]


def _then(read: Make, convert: Callable[[torch.Tensor], torch.Tensor]) -> Make:
    return lambda: convert(read())


def _reader(checkpoint: NativeCheckpoint, key: str) -> Make:
    return lambda: checkpoint.read(key)


def _renames(
    model: str, era: Era, target: Era, layout: dict[str, TensorInfo]
) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """Source model tensor -> (target name, tensor function), through HF."""
    adapter = get_adapter(model)
    source_map = adapter.keymap(era, _NAMES_ONLY)
    target_map = adapter.keymap(target, _NAMES_ONLY)
    native_only = {}
    for key in layout:
        found = source_map.match_native(key)
        if found is not None and found[0].hf is None:  # upstream-only buffers
            native_only[key] = _native_only_target(key, found[1], target_map)
    groups = source_map.plan_to_hf(
        {k: i for k, i in layout.items() if k not in native_only}
    )
    by_hf = {g.hf: g for g in groups}
    hf = {k: i for g in groups for k, i in zip(g.hf, g.hf_infos)}
    problems, renames = [], {}
    fused = [g.hf[0] for g in groups if g.rule.fused is not None]
    if fused:  # no model with fused HF tensors exists in two eras yet
        raise ConversionError(
            f"{model} {era} -> {target}",
            [f"{fused[0]}: fused tensors are not migrated"],
        )
    for new in target_map.plan_from_hf(hf):
        old = by_hf.get(new.hf)
        if old is None:
            problems.append(f"{list(new.native)}: regrouped across the eras")
        elif old.rule.transform.name != new.rule.transform.name:
            problems.append(f"{list(new.native)}: the eras transform it differently")
        else:
            (a,), (b,) = old.native, new.native
            renames[a] = (b, _through_hf(old, new))
    if problems:
        raise ConversionError(f"{model} {era} -> {target}", problems)
    return renames | {k: (v, _same) for k, v in native_only.items()}


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _native_only_target(key: str, fields: dict, target_map) -> str:
    for rule in target_map.rules:
        if rule.hf is None and rule.native:
            name = rule.native.format(**fields)
            if target_map.match_native(name) is not None:
                return name
    raise ConversionError(key, ["an upstream-only tensor with no counterpart"])


def _through_hf(old: Group, new: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor laid out like `old`'s -> like `new`'s. Both eras' rules carry
    the same transform (checked), so HF is only the pivot between the names:
    what one era's rule does, the other's undoes, bit for bit."""
    return lambda tensor: new.to_native(old.to_hf([tensor]))[0]


def _training_state(checkpoint, plan: _Plan, era: Era, target: Era):
    """(objects of OUT, what became of the data position)."""
    objects: dict[str, Any] = {}
    for key in checkpoint.objects:
        if key.startswith(("train_state.", "dataloader.world_size")):
            objects[key] = checkpoint.read_object(key)
    for param, source_param in plan.target_params.items():
        prefix = f"{GROUPS}{source_param}."
        for key in checkpoint.objects:
            if key.startswith(prefix) and "." not in key.removeprefix(prefix):
                new = f"{GROUPS}{param}.{key.removeprefix(prefix)}"
                objects[new] = checkpoint.read_object(key)
    objects |= _lr_scheduler(checkpoint, objects, target)
    ranks = sorted(k for k in checkpoint.objects if k.startswith("dataloader.dp_rank_"))
    skipped = 0
    for key in ranks:
        state = pickle.loads(checkpoint.read_object(key))
        dataset = state.get("dataset_state")
        if not isinstance(dataset, dict):
            raise ConversionError(
                key, ["a data position of dataloader workers: not migrated"]
            )
        for name in PACKING_BUFFERS[era]:
            skipped += len(dataset.pop(name, []))
        dataset |= {name: [] for name in PACKING_BUFFERS[target]}
        objects[key] = pickle.dumps(state)
    data = (
        f"kept for {len(ranks)} data-parallel rank(s), {skipped} packed tokens "
        "of partly used samples skipped"
        if ranks
        else "none saved"
    )
    return objects, data


def _lr_scheduler(checkpoint, objects, target: Era) -> dict[str, Any]:
    """The lr scheduler as `target` saves it (LR_SCHEDULER_STATE)."""
    key = "lr_scheduler.last_epoch"
    if key not in checkpoint.objects:
        return {}
    return LR_SCHEDULER_STATE[target](checkpoint.read_object(key), objects)


def _lambda_lr_state(last_epoch: int, objects: dict[str, Any]) -> dict[str, Any]:
    """LambdaLR's whole state, from the step and the optimizer's lr
    (upstream's schedules are functions of the step)."""
    lr = next(v for k, v in objects.items() if k.endswith(".lr"))
    initial = next(v for k, v in objects.items() if k.endswith(".initial_lr"))
    return {
        "lr_scheduler.last_epoch": last_epoch,
        "lr_scheduler.base_lrs": [initial],
        "lr_scheduler._step_count": last_epoch + 1,
        "lr_scheduler._is_initial": False,
        "lr_scheduler._get_lr_called_within_step": False,
        "lr_scheduler._last_lr": [lr],
    }


# What each era's upstream saves of its lr scheduler: 0.2 LambdaLR's state,
# 0.3 only the step (``last_epoch``; the lr is recomputed on load).
LR_SCHEDULER_STATE: dict[Era, Callable[[int, dict[str, Any]], dict[str, Any]]] = {
    Era.TRAINSPEC: _lambda_lr_state,
    Era.CONFIG_REGISTRY: lambda last_epoch, _: {"lr_scheduler.last_epoch": last_epoch},
}
