"""`rlfw report SWEEP_DIR` (or several run folders): one interactive page that compares runs.

Runs are grouped by the keys that distinguish them (a sweep's swept keys; for loose run folders, the
config keys whose values differ), seeds pooled: each group is one line (the mean over its runs at each
step) with a band (the 95% interval of that mean, Student t over the runs), and each run is a faint line
of its own, hidden until its group's legend entry is toggled on. Panels follow the shipped dashboard
(`rlfw.logging.dashboard.SECTIONS`: one group per ratio factor, ESS and sync, reward and run), drawn
only for keys some run logged. A table gives per group: runs, final reward (mean of each run's last
`FINAL_WINDOW` steps) and reward at the last step every run reached, each with its interval, and the
final ESS, total-ratio spread and resync count.

The page is one HTML file with plotly.js inlined: it opens offline, from anywhere, with zoom, hover and
legend toggles.
"""

from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfw.logging import metrics as m
from rlfw.logging.dashboard import SECTIONS
from rlfw.logging.jsonl import METRICS_FILE, MetricsFileError, read_rows
from rlfw.logging.report import as_number
from rlfw.sweep import SWEEP_FILE, short_key

COMPARE_FILE = "compare.html"
FINAL_WINDOW = 10  # steps averaged for a run's "final" value
SEED_KEYS = ("seed", "engine.seed", "model.seed")
IGNORED_PREFIXES = ("logger.", "resume", "ray_address", "launcher.")
# Two-sided 95% Student t quantiles by degrees of freedom (n - 1); 1.96 beyond the table.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
       10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip


@dataclass
class RunData:
    name: str
    folder: Path
    params: dict[str, str]  # the grouping keys' values
    rows: list[dict[str, Any]]


@dataclass
class Group:
    label: str
    runs: list[RunData] = field(default_factory=list)


def t95(df: int) -> float:
    usable = [d for d in T95 if d <= df]
    return T95[max(usable)] if df <= 30 and usable else 1.96


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval); the half-width is NaN for fewer than two values."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    mean = statistics.fmean(finite)
    if len(finite) < 2:
        return mean, math.nan
    return mean, t95(len(finite) - 1) * statistics.stdev(finite) / math.sqrt(len(finite))


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: json.dumps(tree)}


def read_config(folder: Path) -> dict[str, str]:
    """A run's composed config (its ``config.yaml``) as flat ``key -> JSON value``; {} if absent."""
    import yaml

    path = folder / "config.yaml"
    if not path.is_file():
        return {}
    return flatten(yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def load_run(folder: Path) -> list[dict[str, Any]]:
    rows = read_rows(folder / METRICS_FILE) if (folder / METRICS_FILE).is_file() else []
    if not rows:
        raise MetricsFileError(f"{folder / METRICS_FILE} has no steps; pass run folders that have trained")
    return rows


def sweep_runs(folder: Path) -> list[RunData]:
    """The jobs of a sweep folder that have logged a step, with their swept values (seeds aside). A job
    that has not logged a step (yet) is left out; a damaged metrics file still raises."""
    record = json.loads((folder / SWEEP_FILE).read_text(encoding="utf-8"))
    runs = []
    for job in record["jobs"]:
        run_dir = folder / job["name"]
        rows = read_rows(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
        if not rows:
            continue
        params = {short_key(k): v for k, v in job["params"].items() if short_key(k) not in SEED_KEYS}
        runs.append(RunData(job["name"], run_dir, params, rows))
    if not runs:
        raise MetricsFileError(f"no job of the sweep in {folder} has logged a step yet")
    return runs


def collect(paths: list[Path]) -> list[RunData]:
    """The runs of a sweep folder (grouped by its swept keys) or of several run or sweep folders (every
    sweep's jobs together with the run folders, grouped by the config keys that differ between them, so
    an experiment run as several sweeps reads as one), seeds pooled."""
    is_sweep = [(path / SWEEP_FILE).is_file() for path in paths]
    if len(paths) == 1 and is_sweep[0]:
        return sweep_runs(paths[0])
    rows: dict[Path, list[dict[str, Any]]] = {}
    for path, sweep in zip(paths, is_sweep, strict=True):
        if sweep:
            rows |= {run.folder: run.rows for run in sweep_runs(path)}
        elif not path.is_dir():
            raise MetricsFileError(f"run folder {path} not found; pass a sweep folder or run folders")
        else:
            rows[path] = load_run(path)
    configs = {path: read_config(path) for path in rows}
    keys = sorted({k for c in configs.values() for k in c})
    differing = [
        k
        for k in keys
        if len({c.get(k) for c in configs.values()}) > 1
        and k not in SEED_KEYS
        and not k.startswith(IGNORED_PREFIXES)
    ]
    return [
        RunData(path.name, path, {k: configs[path].get(k, "-") for k in differing}, rows[path])
        for path in rows
    ]


def group_runs(runs: list[RunData]) -> list[Group]:
    groups: dict[str, Group] = {}
    for run in runs:
        label = ", ".join(f"{k}={v}" for k, v in run.params.items()) or run.name
        groups.setdefault(label, Group(label)).runs.append(run)
    return list(groups.values())


def series(run: RunData, key: str) -> dict[int, float]:
    out = {}
    for row in run.rows:
        value = as_number(row.get(key))
        if value is not None and key in row:
            out[int(row["step"])] = value
    return out


def group_curve(group: Group, key: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean over the group's runs, 95% half-width) at every step some run logged ``key``."""
    per_run = [series(run, key) for run in group.runs]
    steps = sorted({s for sr in per_run for s in sr})
    means, halves = [], []
    for step in steps:
        mean, half = mean_ci([sr[step] for sr in per_run if step in sr])
        means.append(mean)
        halves.append(half)
    return steps, means, halves


COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"]  # fmt: skip


def rgba(colour: str, alpha: float) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def key_figure(groups: list[Group], key: str, title: str) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, group in enumerate(groups):
        colour = COLOURS[i % len(COLOURS)]
        steps, means, halves = group_curve(group, key)
        if not steps:
            continue
        if len(group.runs) > 1:
            upper = [mu + h if math.isfinite(h) else mu for mu, h in zip(means, halves, strict=True)]
            lower = [mu - h if math.isfinite(h) else mu for mu, h in zip(means, halves, strict=True)]
            fig.add_trace(go.Scatter(x=steps + steps[::-1], y=upper + lower[::-1], fill="toself",
                                     fillcolor=rgba(colour, 0.18), line={"width": 0}, hoverinfo="skip",
                                     legendgroup=group.label, showlegend=False))  # fmt: skip
        fig.add_trace(go.Scatter(x=steps, y=means, mode="lines", name=f"{group.label} (n={len(group.runs)})",
                                 line={"color": colour}, legendgroup=group.label))  # fmt: skip
        for run in group.runs:
            sr = series(run, key)
            fig.add_trace(go.Scatter(x=list(sr), y=list(sr.values()), mode="lines", name=run.name,
                                     line={"color": rgba(colour, 0.35), "width": 1}, legendgroup=group.label,
                                     showlegend=False, visible="legendonly"))  # fmt: skip
    fig.update_layout(title={"text": title, "font": {"size": 13}}, height=320, margin={"l": 50, "r": 10,
                      "t": 40, "b": 40}, xaxis_title="step", legend={"font": {"size": 10}})  # fmt: skip
    return fig


def window_mean(pairs: list[tuple[float, float]], upto: float) -> float:
    """Mean reward of the last ``FINAL_WINDOW`` (x, reward) pairs with x at most ``upto``."""
    kept = [r for x, r in pairs if x <= upto][-FINAL_WINDOW:]
    return statistics.fmean(kept) if kept else math.nan


def wall_clock(run: RunData) -> list[tuple[float, float]]:
    """(seconds since the first step began, reward) at the end of each step."""
    elapsed, out = 0.0, []
    for row in run.rows:
        step_time, reward = as_number(row.get(m.TIME_STEP)), as_number(row.get(m.REWARD_MEAN))
        elapsed += step_time if step_time is not None and math.isfinite(step_time) else 0.0
        if reward is not None:
            out.append((elapsed, reward))
    return out


def last(run: RunData, key: str) -> float:
    """The last value a run logged for ``key`` (a running count such as ``sync/resyncs``); NaN if none."""
    values = list(series(run, key).values())
    return values[-1] if values else math.nan


def first_resync(run: RunData) -> float:
    steps = [s for s, v in series(run, m.SYNC_RESYNCED).items() if v > 0]
    return float(min(steps)) if steps else math.nan


def summary(groups: list[Group]) -> list[dict[str, Any]]:
    """Per group: runs; reward at the end, at the last step every run reached and at the wall time every
    run reached (each the mean of a run's last ``FINAL_WINDOW`` values there, then over runs, with its 95%
    interval); final ESS, total and lag ratio spread, KV-staleness and router mismatch; pushes and the
    step of the first push (async)."""
    runs = [run for g in groups for run in g.runs]
    common_step = min(int(run.rows[-1]["step"]) for run in runs)
    clocks = [wall_clock(run) for run in runs]
    common_time = min(clock[-1][0] if clock else math.inf for clock in clocks)
    table = []
    for group in groups:

        def final(key: str, runs: list[RunData] = group.runs) -> tuple[float, float]:
            values = []
            for run in runs:
                tail = list(series(run, key).values())[-FINAL_WINDOW:]
                values.append(statistics.fmean(tail) if tail else math.nan)
            return mean_ci(values)

        def reward_by(pairs_of: Any, upto: float, runs: list[RunData] = group.runs) -> tuple[float, float]:
            return mean_ci([window_mean(pairs_of(run), upto) for run in runs])

        def by_step(run: RunData) -> list[tuple[float, float]]:
            return [(float(s), v) for s, v in series(run, m.REWARD_MEAN).items()]

        table.append({
            "group": group.label,
            "runs": len(group.runs),
            "final reward": final(m.REWARD_MEAN),
            f"reward at step {common_step}": reward_by(by_step, common_step),
            f"reward at {common_time:.0f} s": reward_by(wall_clock, common_time),
            "final ESS/N (lag, seq)": final(m.ESS_LAG_SEQ),
            "final max |log ratio| (total)": final(m.ratio_key("total", "max_abs_log")),
            "final max |log ratio| (lag)": final(m.ratio_key("lag", "max_abs_log")),
            "final max |log ratio| (trainer)": final(m.ratio_key("trainer", "max_abs_log")),
            "decode KV staleness (max |log|)": final(m.DECODE_KV_MAX_ABS_LOG),
            "router mismatch frac": final(m.ROUTER_REPLAY_MISMATCH_FRAC),
            "tokens/s": final(m.THROUGHPUT_TOKENS_PER_S),
            "pushes": mean_ci([last(run, m.SYNC_RESYNCS) for run in group.runs]),
            "first push step": mean_ci([first_resync(run) for run in group.runs]),
        })  # fmt: skip
    return table


def cell(value: Any) -> str:
    if isinstance(value, tuple):
        mean, half = value
        if not math.isfinite(mean):
            return "-"
        return f"{mean:.4g}" if not math.isfinite(half) else f"{mean:.4g} ± {half:.2g}"
    return html.escape(str(value))


def logged_anywhere(rows: list[dict[str, Any]], column: str) -> bool:
    return any(not (isinstance(r[column], tuple) and not math.isfinite(r[column][0])) for r in rows)


def table_html(rows: list[dict[str, Any]]) -> str:
    """The summary table, leaving out columns no run logged (e.g. KV staleness in a sync sweep)."""
    columns = [c for c in rows[0] if logged_anywhere(rows, c)]
    rows = [{c: row[c] for c in columns} for row in rows]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    return f'<table id="summary"><tr>{head}</tr>{body}</table>'


def render_compare(paths: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write the comparison page of ``paths`` (a sweep folder, or run folders); returns its path."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    folders = [Path(p) for p in paths]
    runs = collect(folders)
    groups = group_runs(runs)
    logged = {k for run in runs for row in run.rows for k in row}
    sections = []
    for section in SECTIONS:
        figures = []
        for panel in section.panels:
            if panel.kind != "line":
                continue
            for key in panel.keys:
                if key in logged:
                    fig = key_figure(groups, key, f"{panel.title}: {key}")
                    options = {"displaylogo": False}
                    div = pio.to_html(fig, full_html=False, include_plotlyjs=False, config=options,
                                      div_id=f"panel-{key}")  # fmt: skip
                    figures.append(div)
        if figures:
            items = "".join(f'<div class="panel">{f}</div>' for f in figures)
            sections.append(
                f"<section><h2>{html.escape(section.title)}</h2><div class=grid>{items}</div></section>"
            )
    title = folders[0].resolve().name if len(folders) == 1 else f"{len(folders)} runs"
    page = (
        '<!doctype html><html><head><meta charset="utf-8">'
        f"<title>rlfw comparison: {html.escape(title)}</title>"
        f"<script>{get_plotlyjs()}</script>"
        "<style>body{font-family:sans-serif;margin:1.5em}.grid{display:grid;"
        "grid-template-columns:repeat(auto-fill,minmax(480px,1fr));gap:8px}"
        "table{border-collapse:collapse}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}"
        "</style></head><body>"
        f"<h1>rlfw comparison: {html.escape(title)}</h1>"
        f"<p>{len(runs)} runs in {len(groups)} groups; lines are group means over seeds, bands their 95% "
        "intervals (Student t); click a legend entry to hide a group, double-click to isolate it; each "
        "run's own line is in the legend group, off by default.</p>"
        f"<h2>summary (final = mean of each run's last {FINAL_WINDOW} steps)</h2>"
        + table_html(summary(groups))
        + "".join(sections)
        + "</body></html>\n"
    )
    target = Path(out) if out else (folders[0] if len(folders) == 1 else Path.cwd()) / COMPARE_FILE
    target.write_text(page, encoding="utf-8")
    return target
