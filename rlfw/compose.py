"""Compose a :class:`~rlfw.config.RunConfig` from ``recipes/``, ``configs/`` and command-line overrides."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlfw.config import GROUPS, ConfigError, RunConfig, register_configs

DEFAULT_RECIPE = "default"


def project_root() -> Path:
    """Where ``configs/`` and ``recipes/`` live: ``$RLFW_HOME`` or the source checkout."""
    return Path(os.environ.get("RLFW_HOME", Path(__file__).resolve().parents[1]))


def available_recipes() -> list[str]:
    return sorted(p.stem for p in (project_root() / "recipes").glob("*.yaml"))


HYDRA_KEYS = {
    "hydra.run.dir": "logger.run_root (the parent folder) and logger.run_name (the run's folder)",
    "hydra.sweep.dir": "logger.run_root",
    "hydra.job.name": "logger.run_name",
}


def _refuse_hydra_keys(overrides: list[str]) -> None:
    """rlfw composes with Hydra but runs its own job, so ``hydra.*`` settings would be accepted and
    ignored; refuse them, naming the rlfw key that does the job."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "hydra" or key.startswith("hydra."):
            use = HYDRA_KEYS.get(key, "the logger.* keys (see rlfw train --cfg job)")
            raise ConfigError(f"{key} is not read by rlfw; use {use}")


def _path_implies_hf(overrides: list[str]) -> list[str]:
    """``model.path=DIR`` alone means an HF checkpoint: add ``model=hf`` unless a model group is chosen."""
    has_path = any(o.startswith("model.path=") and o != "model.path=null" for o in overrides)
    has_group = any(o.startswith(("model=", "override model=")) for o in overrides)
    return ["model=hf", *overrides] if has_path and not has_group else overrides


def _split_recipe(overrides: list[str]) -> tuple[str, list[str]]:
    _refuse_hydra_keys(overrides)
    overrides = _path_implies_hf(overrides)
    recipe, rest = DEFAULT_RECIPE, []
    for o in overrides:
        if o.startswith("recipe="):
            recipe = o.removeprefix("recipe=")
        else:
            rest.append(o)
    if recipe not in available_recipes():
        raise ConfigError(
            f"recipe={recipe!r} not found in {project_root() / 'recipes'}; "
            f"available: {', '.join(available_recipes())}"
        )
    return recipe, rest


def _allowed_keys(dotted: str) -> str:
    group = dotted.split(".")[0] if "." in dotted else ""
    schema = GROUPS.get(group, RunConfig)
    return ", ".join(f.name for f in dataclasses.fields(schema))


def _explain(err: BaseException) -> ConfigError:
    """Turn Hydra/OmegaConf errors into one message that names the key and what is allowed."""
    text = str(err)
    if m := re.search(r"Could not override '([^']+)'", text):
        return ConfigError(f"unknown config key {m[1]!r}; keys allowed here: {_allowed_keys(m[1])}")
    if m := re.search(r"Could not find '(\w+)/(\w+)'", text):
        options = sorted(p.stem for p in (project_root() / "configs" / m[1]).glob("*.yaml"))
        return ConfigError(f"{m[1]}={m[2]!r} is not a config option; choose one of: {', '.join(options)}")
    details = [str(e).splitlines()[0] for e in _causes(err) if str(e)]
    return ConfigError(" / ".join(dict.fromkeys(details)) or type(err).__name__)


def _causes(err: BaseException | None) -> list[BaseException]:
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__
    return chain


def load_config(overrides: list[str] | None = None) -> RunConfig:
    """The validated run config for ``recipe=NAME`` (default: the embedded default) plus overrides."""
    recipe, rest = _split_recipe(list(overrides or []))
    register_configs()
    root = project_root()
    # Recipes are primary configs; the component groups and the base `config` come from configs/.
    searchpath = f"hydra.searchpath=[file://{root / 'configs'}]"
    try:
        with initialize_config_dir(config_dir=str(root / "recipes"), version_base="1.3"):
            cfg = compose(config_name=recipe, overrides=[*rest, searchpath])
        OmegaConf.resolve(cfg)
        run = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise _explain(err) from err
    except ValueError as err:  # a component's own validation (e.g. the correction's)
        raise ConfigError(str(err)) from err
    assert isinstance(run, RunConfig)
    return run


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))
