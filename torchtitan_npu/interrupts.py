"""Ctrl-C and SIGTERM, handled the same way by every long command: the
handler of each command (stop at once, stop at the next tensor, pass it on to
the run) is installed for a block and the previous one restored after it."""

import contextlib
import signal
import threading
from collections.abc import Callable, Generator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def handled(handler: Callable) -> Generator[None]:
    """SIGINT and SIGTERM go to `handler` for the block (in the main thread;
    elsewhere Python cannot install handlers and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
