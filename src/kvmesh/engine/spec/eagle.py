"""EAGLE-1 draft heads (SafeAILab's, as vLLM's EagleLlamaForCausalLM runs them).

A head maps (the next token t, the target's hidden state h) at position i to a feature g that
predicts the token after t:

    x = fc([embed(t) ; h])      Linear(2H -> H), embedding first, optional bias; no norms,
                                and no zeroed embedding at position 0 (unlike MTP)
    g = layer(x)                one decoder layer whose input_layernorm is the identity:
                                a = x + attn(x); g = a + mlp(post_attention_layernorm(a))
    logits = lm_head(g)         the target's LM head, with no final norm

`embed` is the target's embedding and h its final hidden state (after its norm, what
LlamaForCausalLM.forward returns, as HF's LlamaModel returns it to EAGLE). Depth d > 1 feeds g
back as h, like the MTP drafter, so MtpProposer drives both.

A head directory is what the EAGLE authors publish (yuhuili/EAGLE-LLaMA3-Instruct-8B): a Llama
config.json with num_hidden_layers = 1, and model.safetensors (or *.safetensors, or
pytorch_model.bin) holding `fc.weight` [H, 2H], maybe `fc.bias`, and the decoder layer as
`layers.0.*`. Its `embed_tokens` / `lm_head` copies, if stored, are the target's and unused; a
stored `layers.0.input_layernorm.weight` is unused too (EAGLE never applies it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.attention import AttentionMetadata
from kvmesh.engine.models.llama import (
    DENSE_ARCHITECTURES,
    DecoderLayer,
    LlamaForCausalLM,
    ModelConfig,
    rope_cos_sin,
    rope_inv_freq,
)

logger = logging.getLogger(__name__)

_SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, stored by some exporters


class EagleDrafter(nn.Module):
    """An EAGLE-1 head drafting for `target`, whose embedding and LM head it shares. Same
    interface as mtp.MultiTokenPredictor (layers, layer_for, forward, compute_logits), so
    MtpProposer runs it; its one layer needs one KV cache shaped by `config`."""

    def __init__(self, target: LlamaForCausalLM, config: ModelConfig, fc_bias: bool) -> None:
        super().__init__()
        t = target.config
        if (config.hidden_size, config.vocab_size) != (t.hidden_size, t.vocab_size):
            raise ValueError(
                f"the head has hidden_size {config.hidden_size} and vocab_size "
                f"{config.vocab_size}, the target {t.hidden_size} and {t.vocab_size}"
            )
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        layer = DecoderLayer(config)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.inv_freq = rope_inv_freq(config)  # the head's own RoPE (its config is the target's)
        self._target = (target,)  # a tuple hides it from nn.Module registration

    @property
    def target(self) -> LlamaForCausalLM:
        return self._target[0]

    def layer_for(self, depth: int) -> int:
        if depth < 1:
            raise ValueError(f"depth is 1-based, got {depth}")
        return 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        depth: int = 1,
    ) -> torch.Tensor:
        """input_ids [T]: the token after each row's hidden state; positions [T]: the hidden
        state's position. Returns g [T, H]; feed it back as `hidden` for depth + 1."""
        embeds = self.target.model.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = rope_cos_sin(positions, self.inv_freq, hidden.dtype)
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        return self.layers[self.layer_for(depth)](x, cos, sin, kv_cache, meta)

    def compute_logits(self, g: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """[T, H] -> [T, V] float32 through the target's LM head (EAGLE-1 has no final norm)."""
        head = self.target.lm_head or self.target.model.embed_tokens
        return F.linear(g, head.weight).float()


def load_eagle_head(target: LlamaForCausalLM, path: str | Path) -> EagleDrafter:
    """The EAGLE-1 head in directory `path`, in the target's dtype and on its device;
    ValueError naming what does not fit."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"EAGLE head {path}: not a directory with a config.json")
    config = head_config(json.loads((path / "config.json").read_text()), path)
    names = list(_tensors(path))
    bias = any(name == "fc.bias" for name, _ in names)
    ref = next(target.parameters())
    with torch.device("meta"):
        drafter = EagleDrafter(target, config, bias)
    drafter = drafter.to(ref.dtype).to_empty(device=ref.device)
    params = dict(drafter.named_parameters())
    filled = dict.fromkeys(params, 0)
    packer = SimpleNamespace(config=config, lm_head=None)  # what load_tensor reads of its model
    for name, tensor in names:
        if name in _SHARED or name == "layers.0.input_layernorm.weight":
            logger.debug("EAGLE head %s: %s is not used", path, name)
            continue
        try:
            LlamaForCausalLM.load_tensor(packer, name, tensor, params, filled)
        except ValueError as e:
            raise ValueError(f"EAGLE head {path}: {e}") from None
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ValueError(f"EAGLE head {path}: lacks (or repeats) {missing[:3]}")
    drafter.inv_freq = drafter.inv_freq.to(ref.device)
    return drafter.eval().requires_grad_(False)


def head_config(cfg: dict, path: Path) -> ModelConfig:
    """The head's ModelConfig: a dense Llama-family config.json with one decoder layer."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch is None:
        types = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        arch = types.get(cfg.get("model_type", ""), "LlamaForCausalLM")
    arch = arch.removeprefix("Eagle")  # vLLM's renamed form, EagleLlamaForCausalLM
    if arch not in DENSE_ARCHITECTURES:
        raise ValueError(
            f"EAGLE head {path}: architecture {arch!r} is not supported; use one of "
            f"{DENSE_ARCHITECTURES}"
        )
    cfg = {**cfg, "architectures": [arch]}
    if cfg.get("add_para_norm"):
        raise ValueError(f"EAGLE head {path}: HASS heads (add_para_norm) are not supported")
    try:
        config = ModelConfig.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"EAGLE head {path}: config.json does not load: {e}") from None
    if config.num_hidden_layers != 1:
        raise ValueError(
            f"EAGLE head {path}: num_hidden_layers is {config.num_hidden_layers}; "
            "EAGLE-1 heads have one decoder layer"
        )
    return config


def _tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the head's weights, a leading "model." dropped; stored copies of the
    target's embedding and head are not read from safetensors."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    short = name.removeprefix("model.")
                    if short not in _SHARED:
                        yield short, f.get_tensor(name)
        return
    bin_file = path / "pytorch_model.bin"
    if not bin_file.is_file():
        raise ValueError(f"EAGLE head {path}: no *.safetensors or pytorch_model.bin")
    state = torch.load(bin_file, map_location="cpu", weights_only=True)  # tensors only
    for name, tensor in state.items():
        yield name.removeprefix("model."), tensor
