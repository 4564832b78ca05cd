"""Architecture hyper-parameters of the shared model, read from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {"qwen3": "dense", "llama": "dense", "qwen3_moe": "moe"}


class ModelConfigError(ValueError):
    """An HF config the shared model cannot run; the message names the key and the fix."""


@dataclass(frozen=True)
class ModelArgs:
    """Everything that shapes the shared model; one instance per checkpoint."""

    model_type: str  # "qwen3", "llama" (dense) or "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qk_norm: bool = True  # Qwen3 normalises q and k per head; Llama does not
    max_position_embeddings: int = 32768
    # MoE (qwen3_moe only)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    eos_token_id: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in ``mlp_only_layers`` or off the sparse step."""
        return (
            self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` that `transformers` reads back as the same architecture."""
        arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
        cfg: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "eos_token_id": self.eos_token_id,
        }
        if self.is_moe:
            cfg.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return cfg


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ModelConfigError(f"config.json has no {key!r}; a {cfg.get('model_type')} checkpoint needs it")
    return cfg[key]


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelConfigError(
            f"config.json sets rope_type={rope_type!r}; only plain RoPE ('default') is supported. "
            "Use a checkpoint without RoPE scaling, or remove 'rope_scaling' if the context fits."
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _reject_unsupported_features(cfg: dict[str, Any]) -> None:
    if cfg.get("attention_bias"):
        raise ModelConfigError("config.json sets attention_bias=true; the shared model has no q/k/v/o biases")
    if cfg.get("mlp_bias"):
        raise ModelConfigError("config.json sets mlp_bias=true; the shared model's MLP has no biases")
    if cfg.get("use_sliding_window"):
        raise ModelConfigError("config.json sets use_sliding_window=true; only full attention is supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"config.json sets hidden_act={act!r}; only 'silu' (SwiGLU) is supported")


def _first_eos(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """Validate an HF ``config.json`` dict and turn it into :class:`ModelArgs`."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported architecture: config.json has model_type={model_type!r} "
            f"(architectures={cfg.get('architectures')}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _reject_unsupported_features(cfg)
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    moe: dict[str, Any] = {}
    if SUPPORTED_ARCHITECTURES[model_type] == "moe":
        moe = {
            "num_experts": int(cfg.get("num_experts") or _require(cfg, "num_local_experts")),
            "num_experts_per_tok": int(_require(cfg, "num_experts_per_tok")),
            "moe_intermediate_size": int(_require(cfg, "moe_intermediate_size")),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        }
    args = ModelArgs(
        model_type=model_type,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size")),
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type != "llama",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        eos_token_id=_first_eos(cfg.get("eos_token_id")),
        **moe,
    )
    if args.num_heads % args.num_kv_heads:
        raise ModelConfigError(
            f"num_attention_heads={args.num_heads} is not a multiple of "
            f"num_key_value_heads={args.num_kv_heads}"
        )
    return args
