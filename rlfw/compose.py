"""Compose a :class:`~rlfw.config.RunConfig` from ``recipes/``, ``configs/`` and command-line overrides."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlfw.config import GROUPS, ConfigError, RunConfig, register_configs

DEFAULT_RECIPE = "default"


def project_root() -> Path:
    """Where ``configs/`` and ``recipes/`` live: ``$RLFW_HOME``, else the source checkout, else the
    installed package (a wheel ships them as ``rlfw/configs`` and ``rlfw/recipes``)."""
    if "RLFW_HOME" in os.environ:
        return Path(os.environ["RLFW_HOME"])
    package = Path(__file__).resolve().parent
    checkout = package.parent
    return checkout if (checkout / "configs" / "config.yaml").is_file() else package


def available_recipes() -> list[str]:
    """Shipped recipe names, ``experiments/...`` included (``recipe=NAME`` composes ``recipes/NAME.yaml``)."""
    folder = project_root() / "recipes"
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


@dataclass
class Recipe:
    """A resolved ``recipe=``: the file, and the folders Hydra searches for what it names in ``defaults``."""

    path: Path
    searchpath: list[Path]


def find_recipe(recipe: str, config_dirs: list[Path]) -> Recipe:
    """``recipe=NAME`` in the user's ``--config-dir`` folders, then in ``recipes/``; or ``recipe=FILE.yaml``.

    Whatever the recipe's ``defaults`` name is looked up in the user's folders first, then in rlfw's
    ``configs/`` (component groups and the base ``config``) and ``recipes/`` (so a recipe can build on a
    shipped one, ``defaults: [default, _self_]``).
    """
    root = project_root()
    searchpath = [*config_dirs, root / "configs", root / "recipes"]
    if recipe.endswith((".yaml", ".yml")):
        path = Path(recipe).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"recipe={recipe}: no such file; pass a recipe YAML file or a recipe name")
        return Recipe(path, [path.parent, *searchpath])
    for folder in [*config_dirs, root / "recipes"]:
        path = folder / f"{recipe}.yaml"
        if path.is_file():
            return Recipe(path.resolve(), searchpath)
    where = ", ".join(str(d) for d in [*config_dirs, root / "recipes"])
    raise ConfigError(
        f"recipe={recipe!r} not found in {where}; available: {', '.join(available_recipes())}"
        " (or pass --config-dir DIR, or recipe=path/to/file.yaml)"
    )


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


def split_config_dirs(args: list[str]) -> tuple[list[Path], list[str]]:
    """Take Hydra's ``--config-dir DIR`` / ``--config-dir=DIR`` (repeatable) out of ``args``."""
    dirs, rest, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--config-dir" or a == "-cd":
            if i + 1 >= len(args):
                raise ConfigError("--config-dir needs a folder: --config-dir DIR recipe=NAME")
            dirs.append(args[i + 1])
            i += 2
            continue
        if a.startswith("--config-dir="):
            dirs.append(a.removeprefix("--config-dir="))
        else:
            rest.append(a)
        i += 1
    paths = [Path(d).expanduser().resolve() for d in dirs]
    for d, p in zip(dirs, paths, strict=True):
        if not p.is_dir():
            raise ConfigError(f"--config-dir {d}: no such folder")
    return paths, rest


def _split_recipe(overrides: list[str]) -> tuple[Recipe, list[str]]:
    config_dirs, overrides = split_config_dirs(overrides)
    _refuse_hydra_keys(overrides)
    overrides = _path_implies_hf(overrides)
    recipe, rest = DEFAULT_RECIPE, []
    for o in overrides:
        if o.startswith("recipe="):
            recipe = o.removeprefix("recipe=")
        else:
            rest.append(o)
    return find_recipe(recipe, config_dirs), rest


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
    try:
        cfg = _compose(recipe, rest)
        OmegaConf.resolve(cfg)
        run = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise _explain(err) from err
    except ValueError as err:  # a component's own validation (e.g. the correction's)
        raise ConfigError(str(err)) from err
    assert isinstance(run, RunConfig)
    return run


def _compose(recipe: Recipe, overrides: list[str], with_hydra: bool = False) -> Any:
    # The recipe is the primary config; what its defaults name comes from the search path.
    searchpath = "hydra.searchpath=[" + ",".join(f"file://{p}" for p in recipe.searchpath) + "]"
    with initialize_config_dir(config_dir=str(recipe.path.parent), version_base="1.3"):
        return compose(
            config_name=recipe.path.stem,
            overrides=[*overrides, searchpath],
            return_hydra_config=with_hydra,
        )


def recipe_sweep(overrides: list[str]) -> list[str]:
    """The sweep the chosen recipe declares (Hydra's ``hydra.sweeper.params: {key: "a,b"}``) as overrides."""
    recipe, _ = _split_recipe(list(overrides))
    register_configs()
    try:
        cfg = _compose(recipe, [], with_hydra=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise _explain(err) from err
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    return [f"{key}={value}" for key, value in params.items()]


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))
