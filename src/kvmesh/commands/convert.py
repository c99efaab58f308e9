"""`kvmesh convert-gguf`: write a llama GGUF (by default the embedded SmolLM2) as a local HF
directory that vLLM and HF transformers load: config.json, generation_config.json, the tokenizer
files and model.safetensors.

Weights are dequantised and renamed exactly as the engine's GGUF loader does (the same name map
and the same inverse of llama.cpp's Q/K row permutation), so the directory holds the weights the
engine serves from the GGUF: the same model, tensor for tensor.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")

CONVERT_HELP = (
    "Write a llama GGUF (default: the embedded SmolLM2) as a local HF directory (config.json, "
    "tokenizer, model.safetensors) for vLLM or HF transformers; the weights are dequantised "
    "as the engine's loader does."
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="Directory to write (created if missing).")
    p.add_argument(
        "--gguf",
        default=None,
        help="A llama-architecture .gguf file [default: the embedded SmolLM2].",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="Weight dtype in model.safetensors; float32 keeps the dequantised values exactly "
        "[default: float32].",
    )


def hf_config(config: Any, dtype: str) -> dict:
    """config.json of a LlamaForCausalLM from the engine's ModelConfig of a GGUF."""
    eos = config.eos_token_ids
    return {
        "architectures": [config.architecture],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "torch_dtype": dtype,
    }


def convert_gguf(gguf_path: Path, out: Path, dtype: str = "float32") -> dict:
    """Write ``gguf_path`` as an HF directory at ``out``; returns the config.json written."""
    import gguf
    import torch
    from safetensors.torch import save_file

    from kvmesh.engine.models import loader
    from kvmesh.protocol.tokenizer import load_gguf_tokenizer

    reader = gguf.GGUFReader(gguf_path)
    # scalars and short arrays only, as the loader reads them (vocabulary arrays are slow)
    meta = {k: f.contents() for k, f in reader.fields.items() if len(f.data) <= 64}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: only llama-architecture GGUF files are supported")
    tensors = {t.name: t for t in reader.tensors}
    config = loader._gguf_config(meta, "output.weight" not in tensors, tensors["token_embd.weight"])
    torch_dtype = getattr(torch, dtype)

    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(arr.copy())
        if base.startswith("blk."):
            _, layer, short = base.split(".", 2)
            if short not in loader._GGUF_LAYER_NAMES:
                raise ValueError(f"{gguf_path}: unsupported GGUF tensor {t.name!r}")
            name = f"model.layers.{layer}.{loader._GGUF_LAYER_NAMES[short]}.{kind}"
            # invariant: HF (and vLLM) expect rotate-half Q/K rows; GGUF stores them interleaved
            if short == "attn_q":
                w = loader._unpermute(w, config.num_attention_heads)
            elif short == "attn_k":
                w = loader._unpermute(w, config.num_key_value_heads)
        elif base in loader._GGUF_GLOBAL_NAMES:
            name = f"{loader._GGUF_GLOBAL_NAMES[base]}.{kind}"
        else:
            raise ValueError(f"{gguf_path}: unsupported GGUF tensor {t.name!r}")
        weights[name] = w.to(torch_dtype).contiguous()

    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(config, dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    tokenizer = load_gguf_tokenizer(gguf_path)
    if tokenizer.chat_template is None and meta.get("tokenizer.chat_template"):
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    tokenizer.save_pretrained(out)
    return cfg


def main(args: argparse.Namespace) -> int:
    from kvmesh.protocol.tokenizer import default_gguf_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf_path = Path(args.gguf).expanduser() if args.gguf else default_gguf_path()
    out = Path(args.out).expanduser()
    try:
        cfg = convert_gguf(gguf_path, out, args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
    print(
        f"wrote {out} ({cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['torch_dtype']}) from {gguf_path}"
    )
    return 0
