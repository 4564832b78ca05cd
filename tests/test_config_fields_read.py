"""Every config field is read by the code: a declared knob that nothing reads is a silent no-op.

A user who sets ``algo.kl_coef=0.1`` and sees the run accept it believes a KL penalty is on. This test
finds, for each field of each config class, a read of it in ``rlfw/`` (outside the config classes' own
validation), following types: a read counts for ``SyncConfig.ess_threshold`` only when the expression it
is read from is a ``SyncConfig`` (``run.sync``, a local ``s = d.run.sync``, a parameter annotated
``SyncConfig``, an attribute declared ``sync: SyncConfig``), so ``correction.ess_threshold`` is not
covered by ``sync.ess_threshold``'s reads. Fields that are documentation only would be listed in
``DOCUMENTATION_ONLY`` with the reason; today there are none.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from rlfw.algos.config import CorrectionConfig
from rlfw.config import (
    AlgoConfig,
    EngineConfig,
    LauncherConfig,
    LoggerConfig,
    ModelConfig,
    RunConfig,
    SamplerConfig,
    SyncConfig,
    TaskConfig,
    TrainerConfig,
    VllmSettings,
)

ROOT = Path(__file__).resolve().parents[1]
CLASSES: dict[str, type] = {
    c.__name__: c
    for c in (
        RunConfig,
        ModelConfig,
        EngineConfig,
        SamplerConfig,
        VllmSettings,
        TrainerConfig,
        AlgoConfig,
        CorrectionConfig,
        SyncConfig,
        LoggerConfig,
        TaskConfig,
        LauncherConfig,
    )
}
DOCUMENTATION_ONLY: dict[str, str] = {}  # "Class.field": why nothing reads it
VALIDATION = ("__post_init__", "_check")  # methods whose reads validate a value rather than use it


def _class_of(annotation: ast.expr | None) -> str | None:
    """The config class an annotation names (``X``, ``X | None``, ``"X"``), if any."""
    if annotation is None:
        return None
    text = ast.unparse(annotation).strip("'\"")
    names = [part.strip() for part in text.split("|")]
    hits = [n for n in names if n in CLASSES]
    return hits[0] if hits else None


def _field_types() -> dict[tuple[str, str], str]:
    """(class, field) -> config class of that field, for nested config fields (``RunConfig.sync``)."""
    out = {}
    for name, cls in CLASSES.items():
        for f in dataclasses.fields(cls):
            hit = _class_of(ast.parse(str(f.type), mode="eval").body)
            if hit:
                out[(name, f.name)] = hit
    return out


def _declared_attributes(trees: list[ast.Module]) -> dict[str, str]:
    """Attribute names declared with a config class anywhere in rlfw (``run: RunConfig`` in a dataclass)."""
    out = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                hit = _class_of(node.annotation)
                if hit:
                    out[node.target.id] = hit
    return out


class Reads(ast.NodeVisitor):
    """Collects (config class, field) reads, inferring expression types function by function."""

    def __init__(self, attributes: dict[str, str], nested: dict[tuple[str, str], str]) -> None:
        self.attributes, self.nested = attributes, nested
        self.reads: set[tuple[str, str]] = set()
        self.scopes: list[dict[str, str]] = [{}]
        self.owner: list[str | None] = [None]  # the config class whose body we are in, if any

    def type_of(self, e: ast.expr) -> str | None:
        if isinstance(e, ast.Name):
            return self.scopes[-1].get(e.id)
        if isinstance(e, ast.Attribute):
            base = self.type_of(e.value)
            if base is not None and (base, e.attr) in self.nested:
                return self.nested[(base, e.attr)]
            return self.attributes.get(e.attr)
        return None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.owner.append(node.name if node.name in CLASSES else None)
        self.generic_visit(node)
        self.owner.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        owner = self.owner[-1]
        if owner is not None and node.name.startswith(VALIDATION):
            return
        scope = dict(self.scopes[-1])
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            hit = _class_of(a.annotation)
            if hit:
                scope[a.arg] = hit
        if owner is not None and args.args:
            scope[args.args[0].arg] = owner  # self
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        hit = self.type_of(node.value)
        for target in node.targets:
            if hit and isinstance(target, ast.Name):
                self.scopes[-1][target.id] = hit

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        base = self.type_of(node.value)
        if base is not None and isinstance(node.ctx, ast.Load):
            self.reads.add((base, node.attr))


def reads_in(folder: Path) -> set[tuple[str, str]]:
    trees = [ast.parse(p.read_text()) for p in sorted(folder.rglob("*.py"))]
    visitor = Reads(_declared_attributes(trees), _field_types())
    for tree in trees:
        visitor.visit(tree)
    return visitor.reads


def unread_fields(folder: Path) -> list[str]:
    reads = reads_in(folder)
    return [
        f"{name}.{f.name}"
        for name, cls in CLASSES.items()
        for f in dataclasses.fields(cls)
        if (name, f.name) not in reads and f"{name}.{f.name}" not in DOCUMENTATION_ONLY
    ]


def test_every_config_field_is_read_by_the_code() -> None:
    assert unread_fields(ROOT / "rlfw") == []


def test_the_check_finds_a_field_nothing_reads(tmp_path: Path) -> None:
    """The check bites: a use through the wrong config type or only in validation does not count."""
    (tmp_path / "use.py").write_text(
        "def f(run: RunConfig, cfg: CorrectionConfig) -> None:\n"
        "    s = run.sync\n"
        "    print(s.ess_threshold, cfg.clip_eps)\n"
    )
    missing = unread_fields(tmp_path)
    assert "SyncConfig.ess_threshold" not in missing and "CorrectionConfig.clip_eps" not in missing
    assert "CorrectionConfig.tis_cap" in missing and "AlgoConfig.group_size" in missing
