"""`rlfw report RUN_DIR`: one PNG per panel group and one self-contained page; bad input is named."""

from __future__ import annotations

import base64
import contextlib
import html
import io
import re
from pathlib import Path

import pytest

from rlfw.cli import main
from rlfw.logging.dashboard import SECTIONS
from rlfw.logging.logger import RunLogger
from tests.logging._builders import full_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """`rlfw report` (rendered once: matplotlib takes seconds) on six MoE steps, the last three with
    a correction fraction and an undefined (NaN) lag mean. Returns (run dir, exit code, stdout)."""
    folder = tmp_path_factory.mktemp("run")
    with RunLogger(folder, wandb_enabled=False) as log:
        for step in range(6):
            metrics = full_metrics(step, moe=True)
            if step >= 3:
                metrics |= {"ratio/lag/clip_frac": 0.1 * step, "ratio/lag/mean": float("nan")}
            log.log(step, metrics)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["report", str(folder)])
    return folder, code, out.getvalue()


@pytest.fixture
def run_dir(rendered: tuple[Path, int, str]) -> Path:
    return rendered[0]


def test_one_png_per_panel_group(run_dir: Path) -> None:
    for section in SECTIONS:
        png = run_dir / "report" / f"{section.slug}.png"
        assert png.read_bytes().startswith(PNG_MAGIC), png


def test_page_embeds_every_png_and_names_every_group(run_dir: Path) -> None:
    page = (run_dir / "report" / "index.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(embedded) == len(SECTIONS)
    for data, section in zip(embedded, SECTIONS, strict=True):
        assert base64.b64decode(data) == (run_dir / "report" / f"{section.slug}.png").read_bytes()
        assert f"<h2>{html.escape(section.title)}</h2>" in page
    for ratio in ("trainer", "decode", "sampler", "total", "lag"):
        assert f"<h2>ratio/{ratio}:" in page
    assert 'src="http' not in page and "<link" not in page  # nothing outside the file


def test_page_tables_the_last_steps_scalars(run_dir: Path) -> None:
    table = (run_dir / "report" / "index.html").read_text().split("<h2>last step (5)</h2>")[1]
    assert "<td>ratio/lag/clip_frac</td><td>0.5</td>" in table
    assert "<td>ratio/lag/mean</td><td>NaN</td>" in table
    assert "ratio/lag/hist" not in table


def test_cli_report_succeeds_and_prints_the_page(rendered: tuple[Path, int, str]) -> None:
    run_dir, code, out = rendered
    assert code == 0 and out.strip() == str(run_dir / "report" / "index.html")


def report_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["report", *args])
    return code, capsys.readouterr().err


def test_missing_run_dir_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = report_error([str(tmp_path / "nope")], capsys)
    assert code == 1 and f"run folder {tmp_path / 'nope'} not found" in err


def test_missing_metrics_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = report_error([str(tmp_path)], capsys)
    assert code == 1 and f"{tmp_path / 'metrics.jsonl'} not found" in err and "rlfw train" in err


def test_empty_metrics_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    code, err = report_error([str(tmp_path)], capsys)
    assert code == 1 and "has no steps yet" in err


@pytest.mark.parametrize(
    ("line3", "message"),
    [
        ('{"step": 2, "grad_norm": 1.', "line 3 is not valid JSON"),
        ("[1, 2]", 'line 3 is not an object with an integer "step"'),
        ('{"step": 1, "grad_norm": 1.0}', "line 3 has step 1 after step 1"),
    ],
)
def test_bad_line_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line3: str, message: str
) -> None:
    good = ['{"step": 0, "grad_norm": 1.0}', '{"step": 1, "grad_norm": 1.0}']
    (tmp_path / "metrics.jsonl").write_text("\n".join([*good, line3, '{"step": 9}']) + "\n")
    code, err = report_error([str(tmp_path)], capsys)
    assert code == 1 and message in err and str(tmp_path / "metrics.jsonl") in err
    assert not (tmp_path / "report" / "index.html").exists()


def test_report_needs_exactly_one_folder(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = report_error([], capsys)
    assert code == 2 and "usage: rlfw report RUN_DIR" in err
