"""The shipped dashboard: one panel group per ratio, one for ESS and weight sync, one for the run.

The layout is plain data (`SECTIONS`), read by both `rlfw report` (matplotlib, offline) and
`create_workspace` (a W&B workspace, online), so the local report and the W&B page always group the
same keys the same way. Every key named here comes from `rlfw.logging.metrics`; a test holds that.

Create the W&B workspace (after `wandb login`; `wandb-workspaces` is a dependency):

    python -m rlfw.logging.dashboard ENTITY PROJECT [CONFIG_KEY ...]

Besides `SECTIONS`, the workspace has a "sweep comparison" group: the runs table is grouped by W&B
group (a sweep, `rlfw train -m`) and then by the config keys named (default `correction.name`), and the
comparison panels draw each group's mean with its standard-error band, the same pooling over seeds as
the offline page of `rlfw report SWEEP_DIR`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from rlfw.logging import metrics as m

RATIO_MEANING = {
    "trainer": "trainer vs engine prefill",
    "decode": "engine prefill vs decode path",
    "sampler": "decode path vs what the sampler recorded",
    "total": "trainer vs sampler, the whole ratio",
    "lag": "trainer weights vs the weights that sampled",
    "numerical": "PPO reference vs sampler: the total minus the lag (IcePop masks it)",
}


@dataclass(frozen=True)
class Panel:
    """One chart: a line per key over steps (`line`), or the distribution of one `*/hist` key (`hist`)."""

    title: str
    keys: tuple[str, ...]
    kind: str = "line"


@dataclass(frozen=True)
class Section:
    """A panel group; `slug` names its PNG in the report."""

    title: str
    slug: str
    panels: tuple[Panel, ...]


def ratio_section(ratio: str) -> Section:
    """The panel group of one ratio: mean, worst |log r|, k3 KL, histogram, clip and mask fractions."""
    key = {stat: m.ratio_key(ratio, stat) for stat in m.RATIO_STATS + m.CORRECTION_STATS}
    return Section(
        title=f"ratio/{ratio}: {RATIO_MEANING[ratio]}",
        slug=f"ratio_{ratio}",
        panels=(
            Panel("mean ratio", (key["mean"],)),
            Panel("max |log r|", (key["max_abs_log"],)),
            Panel("k3 KL", (key["k3_kl"],)),
            Panel("log-ratio histogram", (key["hist"],), kind="hist"),
            Panel("clip / mask fraction", (key["clip_frac"], key["mask_frac"])),
        ),
    )


SYNC_SECTION = Section(
    title="ESS and weight sync",
    slug="ess_sync",
    panels=(
        Panel("ESS / N (tokens)", (m.ESS_LAG, m.ESS_TOTAL)),
        Panel("ESS / N (sequences)", (m.ESS_LAG_SEQ, m.ESS_TOTAL_SEQ)),
        Panel("resyncs", (m.SYNC_RESYNCS,)),
        Panel("staleness (mean versions)", (m.SYNC_STALENESS_MEAN,)),
        Panel("max version gap", (m.SYNC_VERSION_GAP_MAX,)),
        Panel("resync events and engine version (async)", (m.SYNC_RESYNCED, m.SYNC_ENGINE_VERSION)),
        Panel(
            "samples dropped as stale / spanning an update (async)",
            (m.SYNC_DROPPED_STALE, m.SYNC_IN_FLIGHT_SAMPLES),
        ),
        Panel(
            "numerics only: trainer, decode KV (async)",
            (m.TRAINER_NUMERICS_MAX_ABS_LOG, m.DECODE_KV_MAX_ABS_LOG),
        ),
        Panel("router replay mismatch (MoE)", (m.ROUTER_REPLAY_MISMATCH_FRAC,)),
    ),
)

RUN_SECTION = Section(
    title="reward, loss and throughput",
    slug="run",
    panels=(
        Panel("reward", (m.REWARD_MEAN, m.REWARD_STD)),
        Panel(
            "evaluation (held-out prompts)",
            (m.EVAL_REWARD_MEAN, m.EVAL_PASS_AT_1, m.EVAL_PASS_AT_K, m.EVAL_GREEDY_PASS),
        ),
        Panel("loss", (m.LOSS_POLICY, m.LOSS_VALUE)),
        Panel("grad norm", (m.GRAD_NORM,)),
        Panel("tokens / s", (m.THROUGHPUT_TOKENS_PER_S,)),
        Panel("samples / s", (m.THROUGHPUT_SAMPLES_PER_S,)),
        Panel("seconds", (m.TIME_STEP, m.TIME_GENERATE, m.TIME_TRAIN, m.TIME_SYNC)),
        Panel("peak resident memory (MiB)", m.MEMORY_KEYS),
    ),
)

SECTIONS: tuple[Section, ...] = (*(ratio_section(r) for r in m.RATIOS), SYNC_SECTION, RUN_SECTION)

COMPARISON = Panel(
    "sweep comparison",
    (m.REWARD_MEAN, m.EVAL_PASS_AT_K, m.ESS_LAG, m.ratio_key("total", "max_abs_log"),
     m.ratio_key("lag", "max_abs_log"), m.SYNC_RESYNCS),
)  # fmt: skip
DEFAULT_GROUP_BY = ("correction.name",)

WORKSPACES_MISSING = (
    "creating the W&B workspace needs the wandb-workspaces package: pip install wandb-workspaces"
)


def build_workspace(
    entity: str, project: str, name: str, group_by: tuple[str, ...] = DEFAULT_GROUP_BY
) -> Any:
    """The `wandb_workspaces` Workspace of `SECTIONS` plus the sweep comparison (not saved).

    wandb-workspaces has no histogram panel type; a `hist` panel becomes a line plot of the key,
    the panel W&B offers for a histogram-valued key.
    """
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as err:
        raise RuntimeError(WORKSPACES_MISSING) from err
    sections = [
        ws.Section(
            name=section.title,
            panels=[wr.LinePlot(title=p.title, x="Step", y=list(p.keys)) for p in section.panels],
            is_open=True,
        )
        for section in SECTIONS
    ]
    comparison: list[Any] = [
        wr.LinePlot(title=key, x="Step", y=[key], groupby_aggfunc="mean", groupby_rangefunc="stderr")
        for key in COMPARISON.keys
    ]
    sections.append(ws.Section(name=COMPARISON.title, panels=comparison, is_open=True))
    # W&B stores the run config as {"run": {...}} (rlfw.train.run), so config keys sit under "run.".
    groupby: list[Any] = [ws.Metric("Group"), *(ws.Config(f"run.{key}") for key in group_by)]
    return ws.Workspace(
        name=name,
        entity=entity,
        project=project,
        sections=sections,
        runset_settings=ws.RunsetSettings(groupby=groupby),
    )


def create_workspace(
    entity: str,
    project: str,
    name: str = "rlfw: training-inference mismatch",
    group_by: tuple[str, ...] = DEFAULT_GROUP_BY,
) -> str:
    """Save the workspace to W&B (online, logged in) and return its URL."""
    workspace = build_workspace(entity, project, name, group_by)
    workspace.save()
    return str(workspace.url)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m rlfw.logging.dashboard ENTITY PROJECT [CONFIG_KEY ...]", file=sys.stderr)
        return 2
    try:
        print(create_workspace(args[0], args[1], group_by=tuple(args[2:]) or DEFAULT_GROUP_BY))
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
