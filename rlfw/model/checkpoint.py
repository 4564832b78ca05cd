"""HF checkpoint I/O: ``config.json`` plus one or several ``*.safetensors`` files, in and out."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from rlfw.model.config import ModelArgs, args_from_hf_config
from rlfw.model.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that carry no weights.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.masked_bias)$")
# transformers >= 5 can save MoE experts fused; the Hub layout (and ours) is one MLP per expert.
_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.down_proj$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the file or tensor and the fix."""


def read_args(path: str | os.PathLike[str]) -> ModelArgs:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found: a checkpoint folder needs an HF config.json")
    return args_from_hf_config(_read_json(config_path))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}); restore it from the original checkpoint"
        ) from err


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{index} has no 'weight_map' object; restore it from the original checkpoint"
            )
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are not in the folder: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}; rlfw reads HF safetensors checkpoints")
    return files


def _unfuse_experts(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if m := _FUSED_GATE_UP.match(name):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{m[1]}.{e}.gate_proj.weight"] = gate[e]
                out[f"{m[1]}.{e}.up_proj.weight"] = up[e]
        elif m := _FUSED_DOWN.match(name):
            for e in range(t.shape[0]):
                out[f"{m[1]}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def read_tensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """All tensors of a checkpoint folder, keyed by HF name, experts in the per-expert layout."""
    tensors: dict[str, Tensor] = {}
    for file in _weight_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not _IGNORED.search(name):
                        tensors[name] = f.get_tensor(name)
        except SafetensorError as err:
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({err}); it may be truncated or corrupt: "
                "copy it again from the original checkpoint"
            ) from err
    return _unfuse_experts(tensors)


def load_state(model: Transformer, tensors: dict[str, Tensor]) -> None:
    """Copy ``tensors`` into ``model``, refusing missing, unexpected or mis-shaped tensors by name."""
    params = dict(model.named_parameters())
    if model.args.tie_word_embeddings:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s) the config asks for, e.g. {missing[:3]}; "
            "check that config.json belongs to these weights"
        )
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) the model does not use, e.g. {unexpected[:3]}; "
            "the architecture in config.json does not match the weights"
        )
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(t.shape)} in the checkpoint but the config implies "
                f"{tuple(p.shape)}"
            )
        with torch.no_grad():
            p.copy_(t.to(p.dtype))


def from_pretrained(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, kernels: str = "default"
) -> Transformer:
    """The shared model loaded from an HF checkpoint folder, in ``dtype``, in scoring mode (``eval``)."""
    args = read_args(path)
    with torch.device("meta"):
        model = Transformer(args, kernels=kernels)
    model = model.to_empty(device="cpu").to(dtype)
    load_state(model, read_tensors(path))
    return model.eval()


def _shards(state: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_pretrained(model: Transformer, path: str | os.PathLike[str], max_shard_bytes: int = 2**31) -> None:
    """Write ``config.json`` and safetensors shards (with an index when more than one), atomically.

    Files go to a temporary folder beside ``path`` that is renamed into place, so a crash never leaves a
    half-written checkpoint under the final name.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    state = {k: v.detach().contiguous().cpu() for k, v in model.named_parameters()}
    config = model.args.to_hf_config() | {
        "torch_dtype": str(model.output_weight.dtype).removeprefix("torch.")
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, name)
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    if final.exists():
        backup = final.with_name(f".{final.name}.old")
        final.rename(backup)
        tmp.rename(final)
        for f in backup.iterdir():
            f.unlink()
        backup.rmdir()
    else:
        tmp.rename(final)
