"""The warm-start cache is shared by every run under a run root: it must appear whole or not at all.

If this breaks, two runs warming up at once write the same folder, and one of them (or a later run)
loads a checkpoint whose files come from both.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rlfw.model import build_preset, from_pretrained
from rlfw.tasks.arithmetic import Arithmetic
from rlfw.tokenizer import build_tiny_tokenizer
from rlfw.train.warm_start import WarmStart, cached_warm_start


def test_two_runs_warming_up_at_once_leave_one_whole_folder(tmp_path: Path) -> None:
    ws = WarmStart("tiny_dense", "arithmetic(max_operand=9)", 3, 3e-3, 8, 0)
    folders: list[Path] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        model = build_preset("tiny_dense", seed=0)
        barrier.wait()
        folders.append(cached_warm_start(tmp_path, model, build_tiny_tokenizer(), Arithmetic(9), ws))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(folders) == 2 and folders[0] == folders[1]
    assert [p.name for p in tmp_path.iterdir()] == [folders[0].name]  # no temporary folder left
    from_pretrained(folders[0])  # a whole checkpoint
    assert (folders[0] / "tokenizer.json").is_file()
    # a partial folder (a crash before writes were atomic) is replaced, not trusted
    (folders[0] / "tokenizer.json").unlink()
    again = cached_warm_start(
        tmp_path, build_preset("tiny_dense", seed=0), build_tiny_tokenizer(), Arithmetic(9), ws
    )
    assert (again / "tokenizer.json").is_file()
