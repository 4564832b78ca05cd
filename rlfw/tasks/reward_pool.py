"""Reward calls in worker processes, each with a timeout, so a reward function that hangs or crashes the
interpreter costs its sample, not the run.

Workers are spawned (not forked: the driver runs Ray's threads) and load each reward function by its
reference once. A call that raises, returns a non-finite value or runs past ``timeout_s`` comes back as
an error string; on a timeout the pool is replaced (its workers are killed with the stuck call) and the
calls that had not finished are sent to the new one.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Mapping, Sequence
from typing import Any

from rlfw.tasks.reward_ref import RewardFn, load_reward

Spec = tuple[str, float, str]  # (reference, weight, name)
_LOADED: dict[Spec, RewardFn] = {}  # per worker process


def _call(specs: tuple[Spec, ...], prompt: str, response: str, row: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for spec in specs:
        fn = _LOADED.get(spec)
        if fn is None:
            fn = _LOADED[spec] = load_reward(spec[0], weight=spec[1], name=spec[2])
        out[fn.name] = fn(prompt, response, row)
    return out


class RewardPool:
    """``workers`` processes calling the reward functions ``specs``; see the module docstring."""

    def __init__(self, specs: list[Spec], workers: int, timeout_s: float) -> None:
        self.specs, self.workers, self.timeout_s = tuple(specs), workers, timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._pool = self._ctx.Pool(workers)

    def score(self, calls: Sequence[tuple[str, str, Mapping[str, Any]]]) -> list[dict[str, float] | str]:
        """Per call ``(prompt, response, row)``: the named values, or why the call failed."""
        results: list[dict[str, float] | str | None] = [None] * len(calls)
        todo = list(range(len(calls)))
        while todo:
            pending = {i: self._pool.apply_async(_call, (self.specs, *calls[i])) for i in todo}
            todo = []
            for i, job in pending.items():
                try:
                    results[i] = job.get(timeout=self.timeout_s)
                except multiprocessing.TimeoutError:
                    results[i] = f"timed out after {self.timeout_s:g} s (task.reward_timeout_s)"
                    finished = {
                        j: p for j, p in pending.items() if j != i and results[j] is None and p.ready()
                    }
                    for j, p in finished.items():
                        results[j] = _outcome(p)
                    todo = [j for j in pending if results[j] is None]
                    self._restart()
                    break
                except Exception as err:  # noqa: BLE001 - whatever the user's function raised
                    results[i] = f"{type(err).__name__}: {err}"
        return [r if r is not None else "lost" for r in results]

    def _restart(self) -> None:
        self._pool.terminate()
        self._pool.join()
        self._pool = self._ctx.Pool(self.workers)

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()


def _outcome(job: Any) -> dict[str, float] | str:
    try:
        value: dict[str, float] = job.get(timeout=0)
        return value
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
