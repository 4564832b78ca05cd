"""``task=dataset``: your own files and reward functions.

If one of these breaks, a user's dataset in one of the promised formats does not load (or loads with
its fields lost), a reward function that fails takes the run down instead of dropping the sample, or a
reward that takes only some fields gets called with ones it does not accept.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfw.compose import load_config
from rlfw.tasks import build_task
from rlfw.tasks.dataset import DatasetTask
from rlfw.tasks.gsm8k import DatasetError
from rlfw.tasks.reward_ref import load_reward, load_rewards
from rlfw.tasks.rewards import score
from rlfw.tokenizer import build_tiny_tokenizer
from rlfw.validation import ConfigError

ROWS = [{"prompt": f"double {n}:", "answer": str(2 * n), "n": n} for n in range(5)]
EXACT = "rlfw.tasks.builtin_rewards:exact_match"


def _write(folder: Path, fmt: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = folder / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path = folder / "d.json"
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        path = folder / "d.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        path = folder / "d.csv"
        path.write_text(
            "prompt,answer,n\n" + "".join(f"{r['prompt']},{r['answer']},{r['n']}\n" for r in ROWS)
        )
    return path


def _task(data_path: str, reward: str = EXACT, **kw: object) -> DatasetTask:
    task = build_task("dataset", data_path, reward=reward, **kw)  # type: ignore[arg-type]
    assert isinstance(task, DatasetTask)
    return task


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_every_format_loads_the_same_problems_and_fields(tmp_path: Path, fmt: str) -> None:
    task = _task(str(_write(tmp_path, fmt)))
    assert [p.prompt for p in task.problems] == [r["prompt"] for r in ROWS]
    assert [int(f["n"]) for f in task.fields] == [r["n"] for r in ROWS]  # other fields travel along
    assert all("prompt" not in f for f in task.fields)
    p = task.problems[3]
    assert task.reward(p, " 6 ") == 1.0 and task.reward(p, "7") == 0.0


def test_a_folder_and_a_glob_name_several_files(tmp_path: Path) -> None:
    _write(tmp_path / "a", "jsonl")
    (tmp_path / "a" / "e.jsonl").write_text(json.dumps({"prompt": "extra", "answer": "x", "n": 9}) + "\n")
    assert len(_task(str(tmp_path / "a")).problems) == len(ROWS) + 1
    assert len(_task(str(tmp_path / "a" / "*.jsonl")).problems) == len(ROWS) + 1


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("no_prompt", r"row 0 has no field 'question'.*set task\.prompt_key"),
        ("nothing", r"names no file"),
        ("mixed", r"use files of one format"),
        ("bad_json", r"reading json failed"),
    ],
)
def test_bad_data_is_one_line_naming_the_fix(tmp_path: Path, setup: str, message: str) -> None:
    path = _write(tmp_path, "jsonl")
    kw: dict[str, object] = {}
    if setup == "no_prompt":
        kw["prompt_key"] = "question"
    elif setup == "nothing":
        path = tmp_path / "missing*.jsonl"
    elif setup == "mixed":
        _write(tmp_path, "csv")
        path = tmp_path
    else:
        path.write_text('{"prompt": "a"}\n{broken\n')
    with pytest.raises(DatasetError, match=message):
        _task(str(path), **kw)


def test_reward_functions_get_only_the_fields_they_declare(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(
        "def some(response, n):\n    return float(response == str(2 * n))\n\n"
        "def every(**row):\n    return float(sorted(row) == ['answer', 'n', 'prompt', 'response'])\n"
    )
    some, every = load_reward(f"{tmp_path}/r.py:some"), load_reward(f"{tmp_path}/r.py:every")
    row = {"answer": "4", "n": 2}
    assert some("double 2:", "4", row) == 1.0 and every("double 2:", "x", row) == 1.0


def test_failing_rewards_drop_the_sample_and_weights_sum_the_parts(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(
        "def flaky(response):\n"
        "    if response == 'boom':\n        raise RuntimeError('grader crashed')\n"
        "    return float('nan') if response == 'nan' else 1.0\n"
    )
    rewards = [{"ref": EXACT, "weight": 2.0}, {"ref": f"{tmp_path}/r.py:flaky", "weight": 0.5, "name": "fmt"}]
    task = _task(str(_write(tmp_path, "jsonl")), reward="", rewards=rewards)
    p = task.problems[2]
    result = score(task, [p, p, p], ["4", "boom", "nan"])
    assert result.rewards == [2.0 * 1.0 + 0.5 * 1.0, None, None] and result.num_failed == 2
    assert result.part_means() == {"reward/exact_match": 1.0, "reward/fmt": 1.0}


@pytest.mark.parametrize(
    ("reward", "rewards", "message"),
    [
        ("nocolon", [], r"task\.reward='nocolon' is not a reward reference"),
        ("no/such/file.py:f", [], r"does not exist"),
        ("rlfw.no_such_module:f", [], r"cannot import rlfw\.no_such_module"),
        ("rlfw.tasks.builtin_rewards:nope", [], r"has no function 'nope'"),
        (EXACT, [{"ref": EXACT}], r"set task\.reward or task\.rewards, not both"),
        ("", [{"ref": EXACT}, {"ref": EXACT}], r"repeated names"),
        ("", [{"ref": EXACT, "name": "mean"}], r"would overwrite reward/mean"),
        ("", [{"ref": EXACT, "wieght": 2}], r"unknown keys \['wieght'\]"),
    ],
)
def test_bad_reward_references_are_config_errors(reward: str, rewards: list, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_rewards(reward, rewards)


def test_chat_prompts_are_rendered_with_the_tokenizer_template(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}) + "\n")
    tok = build_tiny_tokenizer()
    with pytest.raises(DatasetError, match="no chat template"):
        _task(str(path), chat_template=True, tokenizer=tok)
    with pytest.raises(DatasetError, match="chat messages need task.chat_template=true"):
        _task(str(path))
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    task = _task(str(path), chat_template=True, system_prompt="be brief", tokenizer=tok)
    assert task.problems[0].prompt == "system: be brief\nuser: hi\nassistant:"


def test_math_equal_and_the_config_surface(tmp_path: Path) -> None:
    from rlfw.tasks.builtin_rewards import math_equal

    assert math_equal("so #### 14", "14") == 1.0 and math_equal("\\frac{1}{2}", "0.5") == 1.0
    assert math_equal("13", "14") == 0.0
    with pytest.raises(ConfigError, match="task=dataset needs a reward"):
        load_config(["task=dataset", f"task.data_path={tmp_path}"])
    run = load_config(["recipe=example_dataset"])
    task = build_task(run.task.name, run.task.data_path, reward=run.task.reward)
    assert task.sample(3, random.Random(0))[0].prompt.startswith("double ")


def test_the_reward_pool_drops_raising_nan_hanging_and_crashing_calls_and_carries_on(tmp_path: Path) -> None:
    """Each failure costs its own sample only; a hang is cut at task.reward_timeout_s and the pool is
    replaced, after which calls work again."""
    (tmp_path / "r.py").write_text(
        "import os, time\n"
        "def judge(response, n):\n"
        "    if response == 'boom':\n        raise RuntimeError('grader crashed')\n"
        "    if response == 'hang':\n        time.sleep(60)\n"
        "    if response == 'exit':\n        os._exit(3)\n"
        "    return float('nan') if response == 'nan' else float(response == str(2 * n))\n"
    )
    task = build_task(
        "dataset",
        str(_write(tmp_path, "jsonl")),
        reward=f"{tmp_path}/r.py:judge",
        reward_workers=2,
        reward_timeout_s=2.0,
    )
    assert isinstance(task, DatasetTask) and task.pool is not None
    try:
        p = task.problems[2]
        result = score(task, [p] * 5, ["4", "boom", "nan", "hang", "5"])
        assert result.rewards == [1.0, None, None, None, 0.0] and result.num_failed == 3
        assert "grader crashed" in result.errors[0] and "returned nan" in result.errors[1]
        assert "timed out after 2 s" in result.errors[2]
        assert score(task, [p, p], ["4", "3"]).rewards == [1.0, 0.0]  # the new pool works
        crashed = score(task, [p, p], ["exit", "4"])  # the interpreter dies: its call is lost, then cut
        assert crashed.rewards == [None, 1.0] and "timed out" in crashed.errors[0]
    finally:
        task.pool.close()


def test_prompts_the_engine_cannot_answer_are_dropped_and_counted_not_truncated(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n, "answer": "1"}) + "\n" for n in (3, 10, 5, 40)))
    task = _task(str(path))
    assert task.drop_long_prompts(len, 9) == 2
    assert sorted(len(p.prompt) for p in task.problems) == [3, 5]  # whole prompts, none cut
    assert {task.fields[p.uid]["answer"] for p in task.problems} == {"1"}  # fields still follow by uid
    with pytest.raises(
        DatasetError, match="every prompt is longer than 2 tokens; raise engine.max_model_len"
    ):
        task.drop_long_prompts(len, 2)


def test_a_held_out_split_from_a_file_or_a_fraction_is_never_trained_on(tmp_path: Path) -> None:
    data = _write(tmp_path / "train", "jsonl")
    held = tmp_path / "eval.jsonl"
    held.write_text(
        "".join(json.dumps({"prompt": f"double {n}:", "answer": str(2 * n)}) + "\n" for n in (7, 8))
    )
    by_file = _task(str(data), eval_path=str(held))
    assert [p.prompt for p in by_file.eval_problems(5)] == ["double 7:", "double 8:"]
    assert len(by_file.problems) == 5
    assert score(by_file, by_file.eval_problems(1), ["14"]).rewards == [1.0]  # its fields reach the reward
    by_fraction = _task(str(data), eval_fraction=0.4)
    held_out = {p.prompt for p in by_fraction.eval_problems(10)}
    assert len(held_out) == 2 and not held_out & {p.prompt for p in by_fraction.problems}
    assert held_out == {p.prompt for p in _task(str(data), eval_fraction=0.4).eval_problems(10)}  # fixed
    sampled = {p.prompt for p in by_fraction.sample(200, random.Random(0))}
    assert not sampled & held_out


def test_evaluation_without_a_split_is_refused_with_the_fix(tmp_path: Path) -> None:
    task = _task(str(_write(tmp_path, "jsonl")))
    with pytest.raises(DatasetError, match="task.eval_path=FILE or task.eval_fraction"):
        task.eval_problems(4)
    with pytest.raises(DatasetError, match="both need rows"):
        _task(str(_write(tmp_path, "jsonl")), eval_fraction=0.05)
    with pytest.raises(ConfigError, match="pick one"):
        load_config(["task=dataset", "task.data_path=x", f"task.reward={EXACT}", "task.eval_path=y",
                     "task.eval_fraction=0.1"])  # fmt: skip
