"""Multi-token prediction (MTP) draft layers as DeepSeek-V3 and GLM define them.

One MTP layer at depth d maps (the next token t, a hidden state h) at position i to a hidden
state g that predicts the token after t:

    e = enorm(embed(t))          embedding shared with the target; zeroed at position 0
    x = eh_proj([e ; hnorm(h)])  Linear(2H -> H), embedding first
    g = mtp_block(x)             one decoder layer with its own KV cache, same RoPE as the target
    logits = lm_head(norm(g))    the target's LM head; `norm` is the layer's own final norm

Depth 1 takes the target's final hidden state (after its norm, as LlamaForCausalLM.forward
returns it); depth d > 1 takes g from depth d - 1. A config with `num_nextn_predict_layers` = n
carries n layers; drafting k > n tokens reapplies them round-robin (depth d uses layer
(d - 1) % n). Checkpoint names follow DeepSeek-V3 inside `layers.{j}`: enorm, hnorm, eh_proj,
shared_head.norm, and the decoder layer's usual names under mtp_block.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.attention import AttentionMetadata
from kvmesh.engine.models.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    ModelConfig,
    RMSNorm,
    rope_cos_sin,
)

# trained for the embedded SmolLM2 by scripts/train_draft_head.py (absent until shipped)
SMOLLM2_MTP_HEAD = Path(__file__).parent / "heads" / "smollm2_mtp.safetensors"


class SharedHead(nn.Module):
    """The final norm of an MTP layer; the projection is the target's LM head unless a
    checkpoint gives the layer its own (`head`, set by spec.target_mtp when it differs)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head: nn.Linear | None = None


class MtpLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.mtp_block = DecoderLayer(c)
        self.shared_head = SharedHead(c)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """embeds, hidden: [T, H] -> g [T, H] (before shared_head.norm)."""
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.mtp_block(x, cos, sin, kv_cache, meta)


class MultiTokenPredictor(nn.Module):
    """`num_layers` MTP layers drafting for `target`, whose embedding and LM head they share.

    The target is held by reference, not as a submodule: state_dict() holds only the MTP
    weights, `layers.{j}.*`. Each layer needs one KV cache of the target's per-layer shape
    ([2, num_blocks, block_size, kv_heads, head_dim]), indexed by the same slots as the target's.
    """

    def __init__(
        self, target: LlamaForCausalLM, num_layers: int = 1, config: ModelConfig | None = None
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_nextn_predict_layers must be >= 1, got {num_layers}")
        # `config` may narrow the MTP block (e.g. a smaller intermediate_size for a trained head);
        # hidden size, heads and RoPE must match the target's.
        c = config or target.config
        t = target.config
        if (c.hidden_size, c.vocab_size, c.head_dim) != (t.hidden_size, t.vocab_size, t.head_dim):
            raise ValueError("MTP config must keep the target's hidden_size, vocab and head_dim")
        self.config = c
        self.layers = nn.ModuleList(MtpLayer(c) for _ in range(num_layers))
        self.embed_tokens: nn.Embedding | None = None  # own embedding, else the target's
        self._target = (target,)  # a tuple hides it from nn.Module registration

    @property
    def target(self) -> LlamaForCausalLM:
        return self._target[0]

    def layer_for(self, depth: int) -> int:
        """Index of the layer that drafts at `depth` (1-based)."""
        if depth < 1:
            raise ValueError(f"depth is 1-based, got {depth}")
        return (depth - 1) % len(self.layers)

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
        target = self.target
        embeds = (self.embed_tokens or target.model.embed_tokens)(input_ids).to(hidden.dtype)
        cos, sin = rope_cos_sin(positions, target.inv_freq, hidden.dtype)
        layer = self.layers[self.layer_for(depth)]
        return layer(embeds, hidden, positions, cos, sin, kv_cache, meta)

    def compute_logits(self, g: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """[T, H] -> [T, V] float32 through the layer's norm and the target's LM head."""
        shared = self.layers[self.layer_for(depth)].shared_head
        normed = shared.norm(g)
        head = shared.head or self.target.lm_head or self.target.model.embed_tokens
        return F.linear(normed, head.weight).float()

    def init_from_target(self) -> None:
        """Start each layer from the target: its last decoder layer where shapes agree, its
        final norm as shared_head.norm, and eh_proj passing the hidden half through. The
        block's residual branches start at zero (o_proj, down_proj), so an untrained layer
        returns eh_proj's output and drafts what the target itself would say next."""
        last = self.target.model.layers[-1].state_dict()
        with torch.no_grad():
            for layer in self.layers:
                block = layer.mtp_block
                own = block.state_dict()
                same = {k: v for k, v in last.items() if own[k].shape == v.shape}
                block.load_state_dict(same, strict=False)
                block.self_attn.o_proj.weight.zero_()
                block.mlp.down_proj.weight.zero_()
                layer.shared_head.norm.weight.copy_(self.target.model.norm.weight)
                h = self.config.hidden_size
                layer.eh_proj.weight.zero_()
                layer.eh_proj.weight[:, h:].copy_(torch.eye(h))
                layer.eh_proj.weight[:, :h].normal_(0.0, h**-0.5 * 0.5)


def save_mtp_head(mtp: MultiTokenPredictor, path: str | Path, base_model: str) -> int:
    """Write the MTP weights as bfloat16 safetensors with their shape in the metadata; bytes."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()}
    meta = {
        "kind": "mtp",
        "base_model": base_model,
        "num_nextn_predict_layers": str(len(mtp.layers)),
        "hidden_size": str(mtp.config.hidden_size),
        "intermediate_size": str(mtp.config.intermediate_size),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return Path(path).stat().st_size


def load_mtp_head(target: LlamaForCausalLM, path: str | Path) -> MultiTokenPredictor:
    """A head saved by save_mtp_head, in the target's dtype and device; ValueError when it was
    trained for another hidden size or its tensors do not fit."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    if meta.get("kind") != "mtp":
        raise ValueError(f"{path}: not an MTP head (metadata kind={meta.get('kind')!r})")
    if int(meta["hidden_size"]) != target.config.hidden_size:
        raise ValueError(f"{path}: hidden_size {meta['hidden_size']} != the target's")
    config = replace(target.config, intermediate_size=int(meta["intermediate_size"]))
    mtp = MultiTokenPredictor(target, int(meta["num_nextn_predict_layers"]), config)
    ref = next(target.parameters())
    mtp.load_state_dict({k: v.to(ref.dtype) for k, v in tensors.items()})
    return mtp.to(ref.device).eval()
