"""``titan-npu train``'s launcher: check before launch, run torchrun, end readably.

- Everything a user can get wrong is checked here, in one process, before
  torchrun starts (``preflight``): process counts, the torch_npu environment,
  then the config itself (keys, types, model, flavor, layout, paths).
- One run owns a dump folder: a lock file (owner pid and host) refuses a second
  launcher while the first lives.
- Workers die with their launcher: torchrun gets a parent-death signal, and
  each worker asks for one too (``die_with_parent``). torchrun runs in its own
  session: Ctrl-C or SIGTERM reach the launcher only, which passes them on
  once (a second kills torchrun) and ends with the summary of what trained.
- torchrun's output goes to ``<dump>/logs/<launch>/launcher.log``; the terminal
  shows the training log, never a traceback wall: a failure is one line naming
  the rank, the error and the log (``--verbose`` shows everything). The
  hidden local ranks' output goes to files under ``<run>/ranks``.
- A finished run ends with a summary: steps, first and last loss, where the
  logs, TensorBoard files and checkpoints are.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan_npu import interrupts
from torchtitan_npu.errors import LaunchError, UserError

RUN_DIR_ENV = "TITAN_NPU_RUN_DIR"  # where ranks record their failures
RANKS_DIR = "ranks"  # under the run folder: the hidden local ranks' output
LOGGED_RANKS = 10  # torchrun redirects local ranks 0-9 (one-digit) only
LOCK_NAME = ".titan-npu.lock"
_PR_SET_PDEATHSIG = 1


def world_size(nproc_per_node: str, nnodes: str) -> int | None:
    """Processes in the job; None when torchrun decides (elastic node range)."""
    if not re.fullmatch(r"[1-9]\d*", nproc_per_node):
        raise LaunchError(
            f"--nproc-per-node {nproc_per_node!r}: expected a positive integer "
            "(processes per node)"
        )
    if re.fullmatch(r"[1-9]\d*", nnodes):
        return int(nproc_per_node) * int(nnodes)
    if re.fullmatch(r"[1-9]\d*:[1-9]\d*", nnodes):
        low, high = map(int, nnodes.split(":"))
        if low <= high:
            return None
    raise LaunchError(
        f"--nnodes {nnodes!r}: expected a positive integer or MIN:MAX (torchrun)"
    )


def hidden_local_ranks(nproc_per_node: str, shown_rank: int) -> list[int]:
    """The local ranks whose output goes to files rather than the terminal.
    torchrun's per-rank redirect names one-digit local ranks only, so on a
    node of more than ten processes ranks 10 and up stay unlogged."""
    if not nproc_per_node.isdigit():
        return []
    logged = min(int(nproc_per_node), LOGGED_RANKS)
    return [r for r in range(logged) if r != shown_rank]


def rank_output(run_dir: Path, local_rank: int) -> Path | None:
    """The newest stderr file torchrun wrote for a hidden local rank."""
    pattern = f"*/attempt_*/{local_rank}/stderr.log"
    found = sorted((run_dir / RANKS_DIR).glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


class DumpFolderLock:
    """One live run per dump folder: an flock held by the launcher and torchrun.

    The lock file records the owner (pid, host, start); the kernel drops the
    flock when every process holding it exits, so a killed run never leaves a
    stale lock behind. With several nodes each host locks its own file (a
    shared dump folder is written by every node of one run).
    """

    def __init__(self, dump_folder: Path, *, per_host: bool = False) -> None:
        host = socket.gethostname()
        name = f"{LOCK_NAME}.{host}" if per_host else LOCK_NAME
        self.path = dump_folder / name
        self.fd: int | None = None
        self.owner = {"pid": os.getpid(), "host": host, "started": time.ctime()}
        self.created_folder = False

    def acquire(self) -> None:
        import fcntl

        self.created_folder = not self.path.parent.exists()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LaunchError(
                f"dump folder {self.path.parent} cannot be written ({e.strerror}); "
                "choose another --job.dump_folder"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 4096).decode(errors="replace").strip()
            os.close(fd)
            try:
                who = json.loads(owner)
                owner = f"pid {who['pid']} on {who['host']}, since {who['started']}"
            except (ValueError, KeyError, TypeError):
                pass
            raise LaunchError(
                f"dump folder {self.path.parent} is in use by a live run ({owner}); "
                "stop that run or choose another --job.dump_folder"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self.owner).encode())
        self.fd = fd

    def release(self, *, started: bool) -> None:
        """Unlock; a launch that never started leaves no folder it created."""
        if self.fd is None:
            return
        if not started and self.created_folder:
            self.path.unlink()
            try:
                self.path.parent.rmdir()  # only when nothing else is in it
            except OSError:
                pass
        os.close(self.fd)
        self.fd = None


@dataclass
class RunResult:
    returncode: int
    log: Path
    lines: list[str]  # every line torchrun printed (ANSI colours removed)
    seconds: float
    stopped_by: int | None = None  # the signal the launcher passed on to the run


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torch's own glog-style lines (torchrun's agent, C++ and compiler internals):
# in the log file, not on the terminal.
_TORCH_INTERNAL_LOG = re.compile(r"^(\[rank\d+\]:)?[IWE]\d{4} \d\d:\d\d:\d\d")
_TRACEBACK = "Traceback (most recent call last)"


def supervise(
    command: list[str],
    env: dict[str, str],
    *,
    log: Path,
    verbose: bool,
    keep_fds: tuple[int, ...] = (),
) -> RunResult:
    """Run torchrun, log all of its output, show the terminal the readable part."""
    start = time.monotonic()
    lines: list[str] = []
    log.parent.mkdir(parents=True, exist_ok=True)
    # Its own session: Ctrl-C reaches the launcher only, which passes it on
    # (as it does a SIGINT or SIGTERM sent to the launcher alone); a second
    # one kills torchrun, whose workers die with it.
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        pass_fds=keep_fds,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(signal.SIGTERM),
    )
    stopped: list[int] = []

    def forward(signum, frame):
        stopped.append(signum)
        process.send_signal(signum if len(stopped) == 1 else signal.SIGKILL)

    muted = False
    with open(log, "w") as log_file, interrupts.handled(forward):
        log_file.write("$ " + " ".join(command) + "\n")
        assert process.stdout is not None
        for line in process.stdout:
            log_file.write(line)
            log_file.flush()
            lines.append(_ANSI.sub("", line.rstrip("\n")))
            muted = muted or _TRACEBACK in line
            if verbose or not (muted or _TORCH_INTERNAL_LOG.search(line)):
                sys.stdout.write(line)
                sys.stdout.flush()
        returncode = process.wait()
    seconds = time.monotonic() - start
    return RunResult(returncode, log, lines, seconds, stopped[0] if stopped else None)


# Worker environment defaults: progress bars and deprecation notices of
# upstream's dependencies that a user cannot act on (a user's value wins).
QUIET_ENV = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore:'set_vital' is deprecated",
}


def worker_env(run_dir: Path) -> dict[str, str]:
    env = {**QUIET_ENV, **os.environ}
    env[RUN_DIR_ENV] = str(run_dir.resolve())
    return env


def record_failure(exc: BaseException) -> None:
    """In a rank: note the exception for the launcher's one-line summary."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir or isinstance(exc, KeyboardInterrupt):
        return
    if isinstance(exc, SystemExit):
        if exc.code in (0, None):
            return
        message, code = str(exc.code), exc.code if isinstance(exc.code, int) else 1
    elif isinstance(exc, UserError):
        message, code = str(exc), 2
    else:
        message, code = f"{type(exc).__name__}: {exc}", 1
    rank = os.environ.get("RANK", "?")
    path = Path(run_dir) / "errors" / f"rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "message": message, "exitcode": code, "time": time.time()}
    path.write_text(json.dumps(record))


_FAILURE = re.compile(
    r"rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?.*?exitcode\s*:\s*(-?\d+)", re.S
)


def _failures(lines: list[str]) -> list[tuple[str, int, int | None]]:
    """(rank, exit code, local rank) of each failure torchrun lists, its root
    cause first."""
    text = "\n".join(lines)
    block = text[text.rfind("Failures:") :] if "Failures:" in text else ""
    failures = [
        (rank, int(code), int(local) if local else None)
        for rank, local, code in _FAILURE.findall(block)
    ]
    return failures[-1:] + failures[:-1]  # torchrun prints the root cause last


def _root_cause(lines: list[str], records: dict) -> tuple[str, int, int | None] | None:
    """The failure that started it. torchrun names the first it observed, but
    its clock has one-second steps: a rank killed by a signal and a peer
    raising over the broken connection often share a poll. A signal comes from
    outside the run, so a rank that died of one without raising goes first."""
    failures = _failures(lines)
    killed = [f for f in failures if f[1] < 0 and f[0] not in records]
    return (killed or failures or [None])[0]


def failure_line(
    result: RunResult, run_dir: Path, shown_rank: int | None = None
) -> tuple[str, int]:
    """One sentence for a failed run, and the exit code to leave with: the
    first failed rank (torchrun's root cause), what it raised or which signal
    ended it, and where its output and the full log are (``shown_rank``: the
    local rank the terminal showed when it showed one only)."""
    records = {}
    for path in sorted((run_dir / "errors").glob("*.json")):
        record = json.loads(path.read_text())
        records[str(record["rank"])] = record
    root = _root_cause(result.lines, records)
    if root is None and records:
        first = min(records.values(), key=lambda r: r["time"])
        root = (str(first["rank"]), int(first["exitcode"]), None)
    if root is None:
        code = result.returncode
        if code < 0:
            how, code = f"was killed by {signal.Signals(-code).name}", 128 - code
        else:
            how = f"exited with code {code}"
        return f"torchrun {how} (full log: {result.log})", code or 1
    rank, code, local_rank = root
    if rank in records:
        how = "failed: " + _one_line(records[rank]["message"])
        code = int(records[rank]["exitcode"])
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        code = 128 - code
    else:
        how = f"exited with code {code}"
    others = len(set(records) - {rank})
    also = f"; {others} other rank(s) failed after it" if others else ""
    output = None if local_rank is None else rank_output(run_dir, local_rank)
    where = f"its output: {output}; " if output else ""
    unlogged = local_rank is not None and local_rank >= LOGGED_RANKS
    if unlogged and shown_rank not in (None, local_rank) and output is None:
        where = "its output was not kept: rerun with --log-all-ranks; "
    return f"rank {rank} {how}{also} ({where}full log: {result.log})", code


def _one_line(message: str) -> str:
    """An exception message on one line: a short one whole (upstream's
    assertions wrap theirs over a few lines), a long one by its last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines) if len(lines) <= 4 else lines[-1]
    return text[:400].removeprefix("titan-npu: error: ")


_LOSS = r"step:\s*(\d+)\s+loss:\s*(-?[0-9.]+(?:e[-+]?\d+)?)"
_STEP = re.compile(r"(?<!validate )" + _LOSS)  # a training step's log line
_VALIDATION = re.compile(r"validate " + _LOSS)


def _losses(pattern: re.Pattern[str], lines: list[str]) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in map(pattern.search, lines) if m}


def run_summary(result: RunResult, dump_folder: Path, tb_folder: Path | None) -> str:
    """What the run did and where its outputs are."""
    losses = _losses(_STEP, result.lines)
    validation = _losses(_VALIDATION, result.lines)
    lines = []
    stopped = ""
    if result.stopped_by is not None:
        stopped = f"stopped by {signal.Signals(result.stopped_by).name}; "
    if losses:
        first, last = min(losses), max(losses)
        lines.append(
            f"titan-npu: {stopped}trained steps {first}-{last} in "
            f"{result.seconds:.0f} s; loss {losses[first]:.4f} -> {losses[last]:.4f}"
        )
        if validation:
            step = max(validation)
            lines[-1] += f"; validation loss {validation[step]:.4f} (step {step})"
    elif stopped:
        lines.append(f"titan-npu: {stopped}no step trained in {result.seconds:.0f} s")
    else:
        lines.append(f"titan-npu: run finished in {result.seconds:.0f} s (no steps)")
    lines.append(f"  log:          {result.log}")
    if tb_folder is not None and tb_folder.is_dir():
        lines.append(
            f"  tensorboard:  {tb_folder}  "
            f"(view: tensorboard --logdir {tb_folder.parent})"
        )
    checkpoints = sorted(
        (p for p in dump_folder.glob("checkpoint*/step-*") if p.is_dir()),
        key=lambda p: int(p.name.split("-")[-1]) if p.name[5:].isdigit() else -1,
    )
    if checkpoints:
        names = ", ".join(p.name for p in checkpoints[-3:])
        lines.append(f"  checkpoints:  {checkpoints[-1].parent} ({names})")
    return "\n".join(lines)
