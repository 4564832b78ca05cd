"""A short supervised warm start on a task's demonstrations, cached as an HF checkpoint.

A randomly initialised tiny model almost never produces a well-formed answer, so RL would see reward 0
everywhere. A few hundred steps of next-token training on ``(prompt, ideal response)`` pairs teach the
format and a little of the task; RL then improves the accuracy. The result is saved (with its
tokenizer) under a folder named by a hash of everything that determines it, and reused when present.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from rlfw.logging.progress import progress
from rlfw.model import Transformer, save_pretrained
from rlfw.tasks.base import Task


def encode_demos(
    tok: PreTrainedTokenizerBase, demos: list[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids [B, L]``, ``attention [B, L]``, ``target [B, L-1]`` (1 where a response token is predicted)."""
    seqs, prompt_lens = [], []
    for prompt, answer in demos:
        p = tok(prompt, add_special_tokens=False).input_ids
        seqs.append(p + tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id])
        prompt_lens.append(len(p))
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    target = torch.zeros(len(seqs), width - 1)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[i, : len(s)], attention[i, : len(s)] = torch.tensor(s), 1
        target[i, p - 1 : len(s) - 1] = 1
    return ids, attention, target


def warm_start(
    model: Transformer, tok: PreTrainedTokenizerBase, task: Task, steps: int, lr: float, batch: int, seed: int
) -> list[float]:
    """Train ``model`` in place on demonstrations; returns the loss per step."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in progress(range(steps), desc="warm start"):
        ids, attention, target = encode_demos(tok, task.demonstrations(batch, rng))
        logp = model.ops.token_logp(model(ids, attention)[:, :-1], ids[:, 1:])
        loss = -(logp * target).sum() / target.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    model.eval()
    return losses


@dataclass(frozen=True)
class WarmStart:
    """Everything that determines a warm-started checkpoint (its cache key)."""

    model: str  # the preset or checkpoint it starts from
    task: str  # the task and its settings (e.g. "arithmetic(max_operand=9)")
    steps: int
    lr: float
    batch: int
    seed: int

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def cached_warm_start(
    cache_root: Path, model: Transformer, tok: PreTrainedTokenizerBase, task: Task, ws: WarmStart
) -> Path:
    """The warm-started checkpoint folder for ``ws``, trained and saved (with its tokenizer) if missing.

    The folder appears whole or not at all: it is written under a private temporary name and renamed
    into place. Two runs warming up at once both train; the first rename wins and the second run uses
    that folder (the same bits: the warm start is deterministic in ``ws``) and discards its own copy.
    """
    folder = cache_root / f"warm_start-{ws.key()}"
    if (folder / "tokenizer.json").is_file():  # written last: a complete checkpoint
        return folder
    if folder.is_dir():  # a partial folder left by a crash before writes were atomic
        shutil.rmtree(folder, ignore_errors=True)
    warm_start(model, tok, task, ws.steps, ws.lr, ws.batch, ws.seed)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=cache_root))
    try:
        save_pretrained(model, tmp)
        tok.save_pretrained(str(tmp))
        os.rename(tmp, folder)  # atomic; fails if another run put the folder there first
    except OSError:
        if not (folder / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
