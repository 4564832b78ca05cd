"""HF checkpoint I/O: roundtrips are bit-exact, shards load, bad checkpoints are named precisely."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlfw.model import CheckpointError, ModelConfigError, build_preset, from_pretrained, save_pretrained


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_roundtrip_is_bit_exact(tmp_path: Path, preset: str, dtype: torch.dtype) -> None:
    model = build_preset(preset, dtype=dtype, seed=3)
    save_pretrained(model, tmp_path / "ckpt")
    again = from_pretrained(tmp_path / "ckpt", dtype)
    theirs = dict(again.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(_bits(p.detach()), _bits(theirs[name].detach())), name


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    model = build_preset("tiny_moe", seed=4)
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    again = from_pretrained(tmp_path / "sharded")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_bits(model(ids)), _bits(again(ids)))


def test_hf_sharded_checkpoint_loads(tmp_path: Path, dense_ckpt: Path) -> None:
    """A checkpoint sharded by `transformers` itself (index + shards) loads to the same weights."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(dense_ckpt).save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    a, b = from_pretrained(dense_ckpt), from_pretrained(tmp_path / "hf")
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_overwrite_is_atomic_and_leaves_no_temp(tmp_path: Path) -> None:
    save_pretrained(build_preset("tiny_dense", seed=1), tmp_path / "c")
    save_pretrained(build_preset("tiny_dense", seed=2), tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    w = from_pretrained(tmp_path / "c").model.embed_tokens.weight
    assert torch.equal(w, build_preset("tiny_dense", seed=2).model.embed_tokens.weight)


# --- bad input: every error names the tensor, key or file, and the fix ---------------------------------


def _edit_weights(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_tensor_is_named(tmp_path: Path, dense_ckpt: Path) -> None:
    folder = _copy(dense_ckpt, tmp_path / "c")
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(folder)


def test_shape_mismatch_is_named(tmp_path: Path, dense_ckpt: Path) -> None:
    folder = _copy(dense_ckpt, tmp_path / "c")
    _edit_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(63,\).*\(64,\)"):
        from_pretrained(folder)


def test_unexpected_tensor_is_named(tmp_path: Path, dense_ckpt: Path) -> None:
    folder = _copy(dense_ckpt, tmp_path / "c")
    _edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.bias"):
        from_pretrained(folder)


def test_unsupported_architecture_is_named(tmp_path: Path, dense_ckpt: Path) -> None:
    folder = _copy(dense_ckpt, tmp_path / "c")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(cfg | {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelConfigError, match=r"unsupported architecture.*'gpt2'.*qwen3, llama, qwen3_moe"):
        from_pretrained(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn'"),
        ({"attention_bias": True}, r"attention_bias"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3"),
    ],
)
def test_unsupported_features_are_named(tmp_path: Path, dense_ckpt: Path, edit: dict, message: str) -> None:
    folder = _copy(dense_ckpt, tmp_path / "c")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(ModelConfigError, match=message):
        from_pretrained(folder)


def test_missing_folder_and_weights_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(build_preset("tiny_dense").args.to_hf_config()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        from_pretrained(tmp_path / "c")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate_weights", r"model\.safetensors is not a readable safetensors file .*truncated or corrupt"),
        ("garbage_weights", r"model\.safetensors is not a readable safetensors file"),
        ("config_not_json", r"config\.json is not valid JSON"),
        ("config_not_utf8", r"config\.json is not valid JSON"),
    ],
)
def test_damaged_checkpoint_files_are_named_not_raised_raw(tmp_path: Path, damage: str, message: str) -> None:
    folder = tmp_path / "ckpt"
    save_pretrained(build_preset("tiny_dense"), folder)
    weights = next(folder.glob("*.safetensors"))
    weights = weights.rename(folder / "model.safetensors")
    if damage == "truncate_weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "garbage_weights":
        weights.write_bytes(b"\x00garbage" * 50)
    elif damage == "config_not_json":
        (folder / "config.json").write_text('{"model_type": "qwen3",')
    else:
        (folder / "config.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match=message):
        from_pretrained(folder)
