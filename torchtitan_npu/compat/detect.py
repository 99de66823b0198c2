"""Identify the installed upstream torchtitan without importing it."""

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass

from torchtitan_npu.compat.era import Era
from torchtitan_npu.errors import UntestedUpstreamError, UpstreamNotInstalled


@dataclass(frozen=True)
class InstalledUpstream:
    version: str
    commit: str | None  # set when installed from a git URL (PEP 610)


def installed_upstream() -> InstalledUpstream:
    try:
        dist = importlib.metadata.distribution("torchtitan")
    except importlib.metadata.PackageNotFoundError as e:
        raise UpstreamNotInstalled("torchtitan is not installed") from e
    commit = None
    direct_url = dist.read_text("direct_url.json")
    if direct_url:
        commit = json.loads(direct_url).get("vcs_info", {}).get("commit_id")
    return InstalledUpstream(version=dist.version, commit=commit)


def detect_era() -> Era:
    """The API era by feature detection (used for untested upstreams only)."""
    if importlib.util.find_spec("torchtitan.protocols.model_spec") is not None:
        return Era.CONFIG_REGISTRY
    if importlib.util.find_spec("torchtitan.protocols.train_spec") is not None:
        return Era.TRAINSPEC
    raise UntestedUpstreamError(
        "cannot tell the API era of the installed torchtitan: it has neither "
        "torchtitan.protocols.model_spec (0.3.x) nor train_spec (0.2.x)"
    )
