"""SIGTERM and SIGINT as a stop request: how every long-running command ends cleanly.

The kubelet stops a container with SIGTERM; a person at a terminal with SIGINT. Either must make the serving
loop return, so sockets are removed and buffered log lines written. The handler only records the signal and
asks the loop to stop: it may interrupt a log call, so it logs nothing itself (the caller logs what it got).
Handlers are installed before any socket exists and restored afterwards.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(request_stop: Callable[[], None]) -> Iterator[list[str]]:
    """Within the block, SIGTERM/SIGINT call ``request_stop``; yields the list of signal names received."""
    received: list[str] = []

    def on_signal(number: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(number).name)
        request_stop()

    previous = {number: signal.signal(number, on_signal) for number in STOP_SIGNALS}
    try:
        yield received
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
