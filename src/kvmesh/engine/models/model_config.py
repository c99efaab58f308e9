"""The configurations of the embedded engine's models, read from a checkpoint's config.json:
ModelConfig (the decoder: attention, RoPE, norms) and MoeConfig (its sparse-MoE section). Plain
data with no torch: the attention kernels (engine.attention), the decoders (models.llama,
models.moe) and the loader all build on them, and they import none of those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# sparse-MoE families: same attention as their dense kin, experts built by models/moe.py
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
_MODEL_TYPES = {  # config.json model_type -> architecture, for configs without architectures
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_QWEN2 = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # QKV bias by default, never an o_proj bias
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1 (Mixtral always)
    decoder_sparse_step: int = 1  # layer i is sparse iff (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated always-on expert

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("need 0 < num_experts_per_tok <= num_experts")
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")

    def is_sparse(self, layer: int) -> bool:
        step_hit = (layer + 1) % self.decoder_sparse_step == 0
        return step_hit and layer not in self.mlp_only_layers

    @classmethod
    def from_hf_config(cls, cfg: dict) -> MoeConfig | None:
        """The MoE section of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json; None if dense."""
        arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
        if arch in ("MixtralForCausalLM", "mixtral"):
            if cfg.get("sliding_window") is not None:
                raise ValueError("sliding-window attention is not supported")
            return cls(
                num_experts=cfg["num_local_experts"],
                num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                moe_intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=True,  # softmax over the top-k logits
            )
        if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "qwen2_moe", "qwen3_moe"):
            return None
        return cls(
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        )


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None or {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (and on o_proj except for Qwen2)
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    moe: MoeConfig | None = None  # set exactly for MOE_ARCHITECTURES
    # MTP layers stored after the decoder's, as model.layers.{num_hidden_layers + i} (DeepSeek-V3
    # naming); the target's load skips them, spec.target_mtp loads them for method "mtp"
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; use {ARCHITECTURES}")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"{self.architecture} needs moe config iff it is a MoE architecture")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.architecture not in _QWEN2

    @classmethod
    def from_hf_config(cls, cfg: dict, moe: MoeConfig | None = None) -> ModelConfig:
        """From config.json (4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`); `moe` is
        the MoE section parsed by `MoeConfig.from_hf_config` for MOE_ARCHITECTURES."""
        arch = (cfg.get("architectures") or [None])[0]
        if arch is None:
            arch = _MODEL_TYPES.get(cfg.get("model_type", ""))
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
            raise ValueError("only SiLU-gated MLPs without bias are supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else {"rope_type": kind, **rope},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in _QWEN2))),
            qk_norm=arch in _QK_NORM,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            architecture=arch,
            moe=moe,
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )
