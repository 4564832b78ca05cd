"""The shipped dashboard: a panel group per ratio, ESS/sync and run groups, only keys `metrics` defines."""

from __future__ import annotations

import sys

import pytest

from rlfw.logging import metrics as m
from rlfw.logging.dashboard import SECTIONS, build_workspace

ALL_KEYS = {key for section in SECTIONS for panel in section.panels for key in panel.keys}


def section_keys(slug: str) -> set[str]:
    (section,) = [s for s in SECTIONS if s.slug == slug]
    return {key for panel in section.panels for key in panel.keys}


@pytest.mark.parametrize("ratio", ["trainer", "decode", "sampler", "total", "lag", "numerical"])
def test_every_ratio_has_its_group(ratio: str) -> None:
    expected = {f"ratio/{ratio}/{stat}" for stat in m.RATIO_STATS + m.CORRECTION_STATS}
    assert section_keys(f"ratio_{ratio}") == expected


def test_ess_sync_and_run_groups() -> None:
    expected = {*m.ESS_KEYS, *m.SYNC_KEYS, "router/replay_mismatch_frac", *m.ASYNC_KEYS}
    assert expected - {m.SYNC_TRAINED_SAMPLES} == section_keys("ess_sync")
    run = section_keys("run")
    assert {"reward/mean", "loss/policy", "grad_norm", "throughput/tokens_per_s", "time/step"} <= run


def test_only_known_keys_and_every_required_key() -> None:
    assert ALL_KEYS <= set(m.known_keys())
    assert set(m.required_keys(moe=True)) <= ALL_KEYS


def test_hist_panels_show_one_histogram_key_and_line_panels_none() -> None:
    for panel in (p for s in SECTIONS for p in s.panels):
        if panel.kind == "hist":
            assert len(panel.keys) == 1 and m.is_hist_key(panel.keys[0])
        else:
            assert panel.kind == "line" and not any(m.is_hist_key(k) for k in panel.keys)


def test_slugs_and_titles_are_unique() -> None:
    assert len({s.slug for s in SECTIONS}) == len({s.title for s in SECTIONS}) == len(SECTIONS)


def test_missing_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)
    with pytest.raises(RuntimeError, match="pip install wandb-workspaces"):
        build_workspace("entity", "project", "name")


def test_the_real_workspace_mirrors_the_sections_and_adds_the_sweep_comparison() -> None:
    """Built with the installed wandb-workspaces and converted to the model W&B saves (no network)."""
    from rlfw.logging.dashboard import COMPARISON

    ws = build_workspace("ent", "proj", "rlfw", group_by=("correction.name", "sync.mode"))
    assert (ws.entity, ws.project, ws.name) == ("ent", "proj", "rlfw")
    assert [s.name for s in ws.sections] == [s.title for s in SECTIONS] + [COMPARISON.title]
    for got, section in zip(ws.sections, SECTIONS, strict=False):
        assert [(p.title, p.x, p.y) for p in got.panels] == [
            (p.title, "Step", list(p.keys)) for p in section.panels
        ]
    comparison = ws.sections[-1].panels
    assert [p.y for p in comparison] == [[k] for k in COMPARISON.keys]
    assert {(p.groupby_aggfunc, p.groupby_rangefunc) for p in comparison} == {("mean", "stderr")}
    names = [g.name for g in ws.runset_settings.groupby]
    assert names == ["Group", "run.correction.name", "run.sync.mode"]
    assert ws._to_model() is not None  # what save() uploads: validates every panel
