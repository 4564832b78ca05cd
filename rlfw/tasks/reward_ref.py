"""Reward functions named in config: ``package.module:function`` or ``path/to/file.py:function``.

A reward function is called as ``function(prompt=..., response=..., **row)``, where ``row`` holds every
field of the dataset row except the prompt, and returns a float. A function without ``**kwargs`` gets
only the keyword arguments it declares, so ``def reward(response, answer)`` works on rows with many
fields. Several functions combine as a weighted sum (``task.rewards``); each is logged on its own as
``reward/<name>``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfw.validation import ConfigError


@dataclass(frozen=True)
class RewardFn:
    """One named, weighted reward function and the keyword arguments it accepts."""

    name: str
    weight: float
    fn: Callable[..., Any]
    accepts: frozenset[str] | None  # None: takes **kwargs, so every field
    ref: str = ""  # what loaded it (worker processes load it again from this)

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float:
        given = {"prompt": prompt, "response": response, **row}
        kwargs = given if self.accepts is None else {k: v for k, v in given.items() if k in self.accepts}
        value = float(self.fn(**kwargs))
        if not math.isfinite(value):
            raise ValueError(f"reward {self.name} returned {value}")
        return value


def load_reward(ref: str, key: str = "task.reward", weight: float = 1.0, name: str | None = None) -> RewardFn:
    """The function ``ref`` names; a :class:`~rlfw.validation.ConfigError` naming ``key`` when it cannot."""
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise ConfigError(
            f"{key}={ref!r} is not a reward reference; "
            "write package.module:function or path/to/file.py:function"
        )
    if module_ref.endswith(".py"):
        path = Path(module_ref).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{key}={ref!r}: {path} does not exist (relative paths are from the working directory)"
            )
        spec = importlib.util.spec_from_file_location(f"rlfw_user_reward_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's file may raise anything on import
            raise ConfigError(f"{key}={ref!r}: importing {path} failed: {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(module_ref)
        except Exception as err:  # noqa: BLE001
            raise ConfigError(
                f"{key}={ref!r}: cannot import {module_ref}: {type(err).__name__}: {err}"
            ) from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}={ref!r}: {module_ref} has no function {attr!r}")
    where = f"{Path(module_ref).expanduser().resolve()}:{attr}" if module_ref.endswith(".py") else ref
    return RewardFn(name or attr, float(weight), fn, _accepted(fn), where)


def _accepted(fn: Callable[..., Any]) -> frozenset[str] | None:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def load_rewards(reward: str | None, rewards: list[Any]) -> list[RewardFn]:
    """``task.reward`` (one function, weight 1) or ``task.rewards`` (a list of ``{ref, weight, name}``)."""
    if reward and rewards:
        raise ConfigError("set task.reward or task.rewards, not both")
    if reward:
        return [load_reward(reward)]
    out = []
    for i, item in enumerate(rewards):
        key = f"task.rewards[{i}]"
        if not isinstance(item, Mapping) or "ref" not in item:
            raise ConfigError(
                f"{key}={item!r}: each entry is {{ref: module:function, weight: 1.0, name: optional}}"
            )
        unknown = set(item) - {"ref", "weight", "name"}
        if unknown:
            raise ConfigError(f"{key} has unknown keys {sorted(unknown)}; allowed: ref, weight, name")
        out.append(
            load_reward(str(item["ref"]), f"{key}.ref", float(item.get("weight", 1.0)), item.get("name"))
        )
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"task.rewards has repeated names {names}; give each a distinct name")
    taken = sorted(set(names) & RESERVED)
    if taken:
        raise ConfigError(
            f"task.rewards names {taken} would overwrite reward/{taken[0]}; give them another name"
        )
    return out


RESERVED = frozenset({"mean", "std", "failed", "samples"})  # reward/<these> are the run's own metrics
