"""`rlfw report RUN_DIR`: the dashboard of `rlfw.logging.dashboard`, drawn offline from metrics.jsonl.

Writes one PNG per panel group to `RUN_DIR/report/<slug>.png` and one self-contained page,
`RUN_DIR/report/index.html`, with the PNGs embedded as base64 and a table of the last step's scalars,
so the page can be mailed or attached without its folder. Line panels plot each key over steps (a
null, i.e. undefined, value is a gap); histogram panels show the last step that logged one, since
the bin edges follow each step's spread and a heatmap would have to rebin. matplotlib draws through
`Figure` directly (the Agg canvas), never through pyplot, so no display or global state is touched.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from rlfw.logging.dashboard import SECTIONS, Panel, Section
from rlfw.logging.histogram import decode_hist, is_encoded_hist
from rlfw.logging.jsonl import METRICS_FILE, MetricsFileError, read_rows

REPORT_DIR = "report"
COLUMNS = 3


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The steps of `run_dir`, refusing a missing folder or an empty file with the fix in the message."""
    if not run_dir.is_dir():
        raise MetricsFileError(f"run folder {run_dir} not found; pass the folder `rlfw train` wrote")
    rows = read_rows(run_dir / METRICS_FILE)
    if not rows:
        raise MetricsFileError(f"{run_dir / METRICS_FILE} has no steps yet; report after the first step")
    return rows


def as_number(value: Any) -> float | None:
    """A scalar cell as a float (null is NaN, an undefined value); None for anything else."""
    if value is None:
        return math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a scalar key over the steps that logged it; NaN values are gaps."""
    points = [(r["step"], as_number(r[key])) for r in rows if key in r]
    kept = [(step, value) for step, value in points if value is not None]
    return [step for step, _ in kept], [value for _, value in kept]


def mark_not_logged(ax: Axes) -> None:
    ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_line(ax: Axes, rows: list[dict[str, Any]], panel: Panel) -> None:
    drawn = False
    for key in panel.keys:
        steps, values = series(rows, key)
        if steps:
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
            drawn = True
    if drawn:
        ax.legend(fontsize=7, loc="upper left", framealpha=0.6)  # "best" is slow on long runs
        ax.set_xlabel("step")
    else:
        mark_not_logged(ax)


def draw_hist(ax: Axes, rows: list[dict[str, Any]], panel: Panel) -> None:
    key = panel.keys[0]
    last = next((r for r in reversed(rows) if is_encoded_hist(r.get(key))), None)
    if last is None:
        mark_not_logged(ax)
        return
    hist = decode_hist(last[key])
    ax.stairs(hist.counts, hist.edges, fill=True)
    ax.set_xlabel(f"log ratio (step {last['step']}, n={hist.n}, non-finite={hist.nonfinite})")


def render_section(section: Section, rows: list[dict[str, Any]], out_dir: Path) -> Path:
    """Draw one panel group to `out_dir/<slug>.png`."""
    nrows = math.ceil(len(section.panels) / COLUMNS)
    # Fixed margins rather than a layout engine: constrained/tight layout doubles the render time.
    fig = Figure(figsize=(4.5 * COLUMNS, 3.4 * nrows))
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.1, top=0.9, wspace=0.25, hspace=0.45)
    fig.suptitle(section.title)
    axes = fig.subplots(nrows, COLUMNS, squeeze=False).reshape(-1)
    for ax, panel in zip(axes, section.panels, strict=False):
        ax.set_title(panel.title, fontsize=10)
        (draw_hist if panel.kind == "hist" else draw_line)(ax, rows, panel)
    for ax in axes[len(section.panels) :]:
        ax.set_visible(False)
    path = out_dir / f"{section.slug}.png"
    fig.savefig(path, dpi=90)
    return path


def scalar_table(row: dict[str, Any]) -> str:
    """An HTML table of the scalars of one step, keys sorted."""
    cells = [
        f"<tr><td>{html.escape(key)}</td><td>{'NaN' if math.isnan(value) else f'{value:.6g}'}</td></tr>"
        for key, value in ((k, as_number(v)) for k, v in sorted(row.items()) if k != "step")
        if value is not None
    ]
    return "<table><tr><th>key</th><th>value</th></tr>" + "".join(cells) + "</table>"


def figure_html(section: Section, png: Path) -> str:
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    title = html.escape(section.title)
    captions = html.escape(", ".join(p.title for p in section.panels))
    return (
        f'<section><h2>{title}</h2><figure><img alt="{title}" src="data:image/png;base64,{data}">'
        f"<figcaption>{captions}</figcaption></figure></section>"
    )


def render_html(run_dir: Path, rows: list[dict[str, Any]], pngs: list[tuple[Section, Path]]) -> str:
    name = html.escape(run_dir.resolve().name)
    head = (
        f'<!doctype html><html><head><meta charset="utf-8"><title>rlfw report: {name}</title>'
        "<style>body{font-family:sans-serif;margin:2em}img{max-width:100%}"
        "td,th{padding:2px 8px;text-align:left}</style></head><body>"
        f"<h1>rlfw report: {name}</h1><p>steps {rows[0]['step']} to {rows[-1]['step']} "
        f"({len(rows)} logged)</p>"
    )
    body = "".join(figure_html(section, png) for section, png in pngs)
    table = f"<h2>last step ({rows[-1]['step']})</h2>" + scalar_table(rows[-1])
    return head + body + table + "</body></html>\n"


def render_report(run_dir: str | Path) -> Path:
    """Render the report of `run_dir`; returns the path of index.html."""
    run_dir = Path(run_dir)
    rows = load_rows(run_dir)
    out_dir = run_dir / REPORT_DIR
    out_dir.mkdir(exist_ok=True)
    pngs = [(section, render_section(section, rows, out_dir)) for section in SECTIONS]
    index = out_dir / "index.html"
    index.write_text(render_html(run_dir, rows, pngs), encoding="utf-8")
    return index
