"""Every error a user can cause, in one leaf module (it imports nothing of
titan-npu). The CLI and each rank print one as one line, exit 2."""

from collections.abc import Iterable


class ConfigError(ValueError):
    """A train config the running upstream cannot honour."""


class ConverterError(ConfigError):
    """An unknown converter, or one the model or layout cannot take."""


class LaunchError(ValueError):
    """A launch that cannot start (bad process counts, a busy dump folder)."""


class LockError(ValueError):
    """upstream.lock is missing, unreadable or malformed."""


class PatchTargetError(ValueError):
    """A patch target is missing or changed in the installed upstream."""


class UntestedUpstreamError(RuntimeError):
    """The installed torchtitan has no upstream.lock entry."""


class UpstreamNotInstalled(ImportError):
    """torchtitan is not installed."""


class TorchNpuLoadError(ImportError):
    """torch_npu is installed but cannot be loaded (usually: no Ascend CANN)."""


class ConversionError(ValueError):
    """Everything wrong with one conversion, reported together."""

    def __init__(self, what: str, problems: Iterable[str]):
        self.problems = list(problems)
        listed = "\n".join(f"  - {p}" for p in self.problems[:50])
        more = len(self.problems) - 50
        if more > 0:
            listed += f"\n  ... and {more} more"
        super().__init__(f"{what}: {len(self.problems)} problem(s)\n{listed}")


# What a rank reports as one line before training starts.
RANK_ERRORS = (ConfigError, UntestedUpstreamError, PatchTargetError, TorchNpuLoadError)
# What the CLI reports as one line: every ValueError above, and a torch_npu
# that cannot load.
CLI_ERRORS = (ValueError, TorchNpuLoadError)
