"""Decoder for the Llama / Qwen2 / Qwen3 family over a paged KV cache.

RMSNorm, RoPE (default, linear or Llama-3 scaling), grouped-query attention, SwiGLU MLP, tied
embeddings, QKV bias (Qwen2) and per-head q/k RMSNorm (Qwen3). The Q/K/V and gate/up projections
are fused into one matmul each; `load_weights` packs HF-named checkpoint tensors into them.
An `mlp_factory` swaps a layer's MLP for another module (models/moe.py's sparse-MoE blocks).
Its configuration lives in models.model_config, below the attention kernels (ModelConfig and
DENSE_ARCHITECTURES are read from here too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.attention import AttentionMetadata, paged_attention
from kvmesh.engine.models.model_config import DENSE_ARCHITECTURES as DENSE_ARCHITECTURES
from kvmesh.engine.models.model_config import ModelConfig as ModelConfig


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] of each position, in dtype (shared by all layers)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, after any rope_scaling."""
    exponent = torch.arange(0, c.head_dim, 2, device="cpu").float() / c.head_dim  # not meta
    inv = 1.0 / (c.rope_theta**exponent)
    s = c.rope_scaling or {}
    if s.get("rope_type") == "linear":
        inv = inv / s["factor"]
    elif s.get("rope_type") == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = torch.where(medium, blended, scaled)
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout): x [T, heads, hd], cos/sin [T, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 whatever the model dtype, as HF does
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_size, self.kv_size = self.heads * c.head_dim, self.kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_proj_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.view(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c) if mlp is None else mlp  # any [T, hidden] -> [T, hidden] module

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


MlpFactory = Callable[[ModelConfig, int], "nn.Module | None"]  # (config, layer) -> MLP or None


class DecoderModel(nn.Module):
    def __init__(self, c: ModelConfig, mlp_factory: MlpFactory | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, mlp_factory(c, i) if mlp_factory else None)
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


# HF projection name -> our fused projection holding it; shards are stacked in this order
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, mlp_factory: MlpFactory | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, mlp_factory)
        # tied: compute_logits reuses the embedding (no second parameter, so no tie to keep)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(config)  # plain tensor: survives to_empty() from meta

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; ValueError on unknown, misshapen or missing ones."""
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)  # elements copied per parameter; must end == numel
        for name, tensor in weights:
            self.load_tensor(name, tensor, params, filled)
        bad = [n for n, p in params.items() if filled[n] != p.numel()]
        if bad:
            raise ValueError(f"checkpoint lacks (or repeats) {len(bad)} tensors, e.g. {bad[:3]}")

    def load_tensor(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter], filled: dict
    ) -> None:
        """Copy one HF-named tensor into its (possibly fused) parameter; count it in `filled`."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        tied_head = name == "lm_head.weight" and self.lm_head is None
        if tied_head or name.endswith("rotary_emb.inv_freq"):
            return  # a tied checkpoint that still stores the head; RoPE is recomputed
        *module, proj, kind = name.split(".")
        target = ".".join([*module, _FUSED.get(proj, proj), kind])
        if target not in params:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        dest = params[target].data
        if proj in _FUSED:
            # gate/up halves follow the MLP's own width (dense, shared-expert or dense-in-MoE)
            inter = dest.shape[0] // 2
            rows |= {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}
            dest = dest[slice(*rows[proj])]
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        filled[target] += dest.numel()
