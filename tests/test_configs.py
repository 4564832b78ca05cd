"""Every file in configs/ and recipes/ composes into a validated RunConfig; bad keys and values are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfw.compose import available_recipes, load_config, project_root
from rlfw.config import ConfigError, RunConfig

ROOT = project_root()
# Values a user must supply for options that point at local files; the config test supplies stand-ins.
NEEDS = {"model/hf.yaml": ["model.path=/ckpt"], "task/gsm8k.yaml": ["task.data_path=/data.jsonl"]}
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
