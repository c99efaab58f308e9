"""Decoder for the Llama / Qwen2 / Qwen3 family over a paged KV cache.

RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, optionally tied embeddings, QKV bias (Qwen2)
and per-head q/k RMSNorm (Qwen3). QKV and gate/up projections are fused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.attention import AttentionMetadata, paged_attention

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope = cfg.get("rope_scaling") or None
        if rope is not None:
            kind = rope.get("rope_type", rope.get("type"))
            if kind not in ("llama3", "default", None):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get(
                "rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            ),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            architecture=arch,
        )


def rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    s = c.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "llama3":
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        freqs = torch.outer(
            torch.arange(c.max_position_embeddings, dtype=torch.float32), rope_inv_freq(c)
        )
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_size, self.kv_size = self.num_heads * c.head_dim, self.num_kv * c.head_dim
        self.scale = c.head_dim**-0.5
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_proj = nn.Linear(
            c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x, positions, rope: RotaryEmbedding, cache, meta: AttentionMetadata):
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv, self.head_dim)
        v = v.view(-1, self.num_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        attn = paged_attention(q, k, v, cache, meta, self.scale)
        x = x + self.o_proj(attn.reshape(-1, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = RotaryEmbedding(c)
        self.lm_head = (
            None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rope, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
