"""Every file in configs/ and recipes/ composes into a validated RunConfig; bad keys and values are named."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rlfw.compose import available_recipes, load_config, project_root
from rlfw.config import GROUPS, ConfigError, RunConfig

ROOT = project_root()
# Values a user must supply for options that point at local files; the config test supplies stand-ins.
NEEDS = {
    "model/hf.yaml": ["model.path=/ckpt"],
    "task/gsm8k.yaml": ["task.data_path=/data.jsonl"],
    "task/dataset.yaml": ["task.data_path=/data.jsonl", "task.reward=m:f"],
}
RECIPE_NEEDS = {
    "qwen3_1p7b_grpo_dlc": ["model.path=/ckpt", "task.data_path=/d.jsonl"],
    "qwen3_1p7b_grpo_vllm": ["model.path=/ckpt", "task.data_path=/d.jsonl"],
    "qwen3_30b_a3b_r3": ["model.path=/ckpt", "task.data_path=/d.jsonl"],
}
OPTIONS = sorted(str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").glob("*/*.yaml"))


def test_there_is_something_to_compose() -> None:
    assert len(OPTIONS) >= 15 and "default" in available_recipes()


@pytest.mark.parametrize("option", OPTIONS)
def test_every_config_option_composes(option: str) -> None:
    group, name = Path(option).parent.name, Path(option).stem
    run = load_config([f"{group}={name}", *NEEDS.get(option, [])])
    assert isinstance(run, RunConfig)
    if group == "correction":
        assert run.correction.name == name


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_composes_and_says_what_it_needs(recipe: str) -> None:
    run = load_config([f"recipe={recipe}", *RECIPE_NEEDS.get(recipe, [])])
    assert isinstance(run, RunConfig)
    header = (ROOT / "recipes" / f"{recipe}.yaml").read_text().split("defaults:")[0]
    for word in ("Needs:", "wall time", "CI:"):
        assert word in header, f"recipes/{recipe}.yaml header does not say {word!r}"


def test_embedded_default_is_tiny_native_cpu() -> None:
    run = load_config([])
    assert (run.model.preset, run.engine.name, run.kernels) == ("tiny_dense", "native", "invariant")


def test_corrections_toggle_from_the_command_line() -> None:
    run = load_config(
        ["correction=tis", "correction.tis_cap=3", "model=tiny_moe", "model.router_replay=true"]
    )
    assert (run.correction.name, run.correction.tis_cap, run.model.router_replay) == ("tis", 3.0, True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.foo=1"], r"unknown config key 'model\.foo'; keys allowed here: path, preset"),
        (["bogus=1"], r"unknown config key 'bogus'; keys allowed here: kernels, seed, resume"),
        (["correction=bogus"], r"correction='bogus' is not a config option; choose one of: centering, dlc"),
        (["sync.policy=sometimes"], r"sync\.policy='sometimes' is not allowed; choose one of: every_step"),
        (["kernels=fast"], r"kernels='fast' is not allowed; choose one of: invariant, default"),
        (
            ["correction.mis_level=x"],
            r"correction\.mis_level='x' is not allowed; choose one of: token, sequence",
        ),
        (["trainer.lr=abc"], r"trainer\.lr=abc.*could not be converted"),
        (["recipe=nope"], r"recipe='nope' not found.*available: default"),
        (["model=hf"], r"set exactly one of model\.path"),
        (["task=gsm8k"], r"task\.data_path"),
        (["model.router_replay=true"], r"needs an MoE model"),
    ],
)
def test_bad_config_is_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def _numeric_fields(cls: type, prefix: str) -> list[tuple[type, str, str, str]]:
    """(config class, field, full key, annotated type) of every number a config holds, nested included."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        kind = str(f.type)
        if dataclasses.is_dataclass(f.default_factory) if callable(f.default_factory) else False:
            out += _numeric_fields(f.default_factory, f"{key}.")  # type: ignore[arg-type]
        elif kind.split(" | ")[0] in ("int", "float"):
            out.append((cls, f.name, key, kind))
    return out


NUMERIC = [
    *(field for group, cls in GROUPS.items() for field in _numeric_fields(cls, f"{group}.")),
    *(field for field in _numeric_fields(RunConfig, "") if "." not in field[2]),
]


def test_the_numeric_fields_are_all_found() -> None:
    keys = {key for _, _, key, _ in NUMERIC}
    assert {"trainer.checkpoint_every", "engine.sampler.temperature", "seed", "correction.tis_cap"} <= keys
    assert len(keys) >= 35


@pytest.mark.parametrize(("cls", "name", "key", "kind"), NUMERIC, ids=[k for _, _, k, _ in NUMERIC])
def test_every_numeric_field_refuses_a_value_outside_its_range(
    cls: type, name: str, key: str, kind: str
) -> None:
    """Negative numbers (no count, size, rate or seed here is negative) and, for floats, NaN: each is a
    one-line ConfigError naming the full key, at construction, before anything runs."""
    bad: list[float] = [-1] + ([float("nan")] if kind.startswith("float") else [])
    for value in bad:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}={re.escape(repr(value))} "):
            cls(**{name: value})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.checkpoint_every=0"], r"trainer\.checkpoint_every=0 is out of range"),
        (["trainer.steps=0"], r"trainer\.steps=0 is out of range"),
        (["algo.group_size=1"], r"algo\.group_size=1 with algo=grpo: every advantage would be 0"),
        (["engine.sampler.precision=fp16"], r"^engine\.sampler\.precision='fp16' is not allowed"),
        (["algo.gamma=1.5"], r"algo\.gamma=1\.5 is out of range; allowed: \[0\.0, 1\.0\]"),
    ],
)
def test_values_that_ran_and_failed_later_are_refused_up_front(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_a_model_path_alone_means_an_hf_checkpoint() -> None:
    """`rlfw audit model.path=DIR`, as the README writes it, without also saying model=hf."""
    run = load_config(["model.path=/ckpt"])
    assert run.model.path == "/ckpt" and run.model.preset is None
    assert load_config(["model=hf", "model.path=/ckpt"]).model == run.model
    assert load_config([]).model.preset == "tiny_dense"
