"""Every error a user can cause, in one leaf module (it imports nothing of
titan-npu). Each is a ``UserError``: the CLI and each rank print it as one
line, exit 2. Any other exception is a bug in titan-npu (or below it) and
keeps its traceback (``cli.main``)."""

from collections.abc import Iterable


class UserError(Exception):
    """Something the user can fix: shown as one line that names it, exit 2."""


class ConfigError(UserError):
    """A train config the running upstream cannot honour."""


class ConverterError(ConfigError):
    """An unknown converter, or one the model or layout cannot take."""


class LaunchError(UserError):
    """A launch that cannot start (bad process counts, a busy dump folder)."""


class LockError(UserError):
    """upstream.lock is missing, unreadable or malformed."""


class PatchTargetError(UserError):
    """A patch target is missing or changed in the installed upstream."""


class UntestedUpstreamError(UserError):
    """The installed torchtitan has no upstream.lock entry."""


class SyncError(UserError):
    """A `compat sync` candidate that cannot be installed or compared."""


class PlanError(UserError):
    """A memory plan that cannot be made: a bad memory size, an unknown
    device, a layout the planner cannot simulate."""


class UpstreamNotInstalled(UserError):
    """torchtitan is not installed."""


class TorchNpuLoadError(UserError):
    """torch_npu is installed but cannot be loaded (usually: no Ascend CANN)."""


class DeviceError(UserError):
    """A device type that is unknown or absent on this machine."""


class UsageError(UserError):
    """A command-line value a command cannot take (not a train config's)."""


class ConversionError(UserError):
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
