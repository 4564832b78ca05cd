"""The shared transformer (dense Qwen3/Llama and Qwen3-MoE) used by trainer and engine alike."""

from rlfw.model.cache import KVCache
from rlfw.model.checkpoint import CheckpointError, from_pretrained, read_args, save_pretrained
from rlfw.model.config import ModelArgs, ModelConfigError, args_from_hf_config
from rlfw.model.presets import DTYPES, PRESETS, build_preset, load_model
from rlfw.model.routing import RouterTrace
from rlfw.model.transformer import Transformer

__all__ = [
    "CheckpointError",
    "KVCache",
    "ModelArgs",
    "ModelConfigError",
    "RouterTrace",
    "Transformer",
    "PRESETS",
    "args_from_hf_config",
    "build_preset",
    "load_model",
    "DTYPES",
    "from_pretrained",
    "read_args",
    "save_pretrained",
]
