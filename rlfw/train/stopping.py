"""Stopping a run cleanly: SIGINT (Ctrl-C) and SIGTERM (what SLURM, Kubernetes and ``kill`` send) end the
run with a checkpoint of the last finished step.

A step's optimizer update, its run state and its metrics row go together: :func:`stop_deferred` holds the
two signals while a step commits and delivers them once it has, so a stop never lands between the update
and the state a checkpoint records (a resumed run would train that step twice), nor between the state and
the row (a resumed run would have a hole in its metrics).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: checkpoint, then exit 143."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def handle_stop_signals() -> dict[int, Any]:
    """Route SIGTERM to :class:`Terminated` (over Ray's handler, which aborts) and SIGINT to
    ``KeyboardInterrupt`` even when the run was started with SIGINT ignored (a background job of a
    non-interactive shell inherits that), so ``kill -INT`` always checkpoints. Returns the handlers it
    replaced; nothing off the main thread, where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }


@contextmanager
def stop_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block; when it ends normally, deliver the first that arrived to the
    handler in force before it (under :func:`handle_stop_signals`: the exception that stops the run).
    When the block raises, its exception stops the run and a held signal adds nothing. Off the main
    thread (no handlers there) the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])
