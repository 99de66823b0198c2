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


class PlanError(ValueError):
    """A memory plan that cannot be made: a bad memory size, an unknown
    device, a layout the planner cannot simulate."""


class UpstreamNotInstalled(ImportError):
    """torchtitan is not installed."""


class TorchNpuLoadError(ImportError):
    """torch_npu is installed but cannot be loaded (usually: no Ascend CANN)."""


class ConversionError(ValueError):
    """Everything wrong with one conversion, found together; the message is
    one line (the first problems and how many more), ``problems`` all."""

    SHOWN = 3

    def __init__(self, what: str, problems: Iterable[str]):
        self.problems = list(problems)
        shown = "; ".join(self.problems[: self.SHOWN])
        more = len(self.problems) - self.SHOWN
        if more > 0:
            shown += f"; and {more} more like these"
        super().__init__(f"{what}: {shown}")


class Interrupted(Exception):
    """A signal (Ctrl-C, SIGTERM) stopped a command; what it was writing is gone."""

    def __init__(self, signum: int, what: str):
        import signal

        self.signum = signum
        super().__init__(f"{what} stopped by {signal.Signals(signum).name}")


# What a rank reports as one line before training starts.
RANK_ERRORS = (ConfigError, UntestedUpstreamError, PatchTargetError, TorchNpuLoadError)
# What the CLI reports as one line: every ValueError above, and a torch_npu
# that cannot load.
CLI_ERRORS = (ValueError, TorchNpuLoadError)
