"""A target model's own MTP layers (DeepSeek-V3 / GLM naming), read from its HF directory.

A config.json with `num_nextn_predict_layers` = n stores n MTP layers after the decoder's, at
`model.layers.{num_hidden_layers + i}.`: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the
decoder layer's usual names (input_layernorm, self_attn.*, post_attention_layernorm, mlp.*),
and usually copies of the embedding (`embed_tokens`) and LM head (`shared_head.head`). The
target's own load skips these layers (models/loader.py); load_target_mtp reads them into a
mtp.MultiTokenPredictor. A stored embedding or head equal to the target's is shared with it;
one that differs is kept as the predictor's own, so the equations are the checkpoint's.

The MTP layer's decoder layer is built like the target's dense layers (its attention, QKV bias,
q/k norms and SwiGLU MLP). A sparse-MoE MTP layer (a MoE target's, where the layer index is
sparse) is refused: kvmesh has no sparse-MoE MTP block.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from kvmesh.engine.models.llama import LlamaForCausalLM, ModelConfig
from kvmesh.engine.spec.mtp import MultiTokenPredictor
from kvmesh.protocol.wording import noun_for

logger = logging.getLogger(__name__)

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # the MTP layer's, not the block's


def check_supported(config: ModelConfig) -> None:
    """ValueError naming what kvmesh lacks for this target's MTP layers, if anything."""
    n, first = config.num_nextn_predict_layers, config.num_hidden_layers
    if n < 1:
        raise ValueError(
            "the target model carries no MTP layers (num_nextn_predict_layers = 0); give an MTP "
            'head file as "model" (the embedded SmolLM2\'s head is "model": "smollm2")'
        )
    moe = config.moe
    sparse = [first + i for i in range(n) if moe is not None and moe.is_sparse(first + i)]
    if sparse:
        raise ValueError(
            f"the MTP {noun_for(len(sparse), 'layer')} {sparse} of this {config.architecture} "
            f"{noun_for(len(sparse), 'is a sparse-MoE layer', 'are sparse-MoE layers')}; "
            "kvmesh's MTP drafter builds dense decoder layers only (no sparse-MoE MTP block)"
        )


def load_target_mtp(
    target: LlamaForCausalLM, config: ModelConfig, path: str | Path | None
) -> MultiTokenPredictor:
    """The target's `num_nextn_predict_layers` MTP layers from the HF directory it was loaded
    from, in its dtype and on its device; ValueError naming what is missing or misfits."""
    check_supported(config)
    if path is None or not Path(path).is_dir():
        raise ValueError(
            f"the target's own MTP layers load from its HF directory, and this target was loaded "
            f"from {str(path) if path else 'elsewhere'}; give an MTP head file as 'model'"
        )
    n, first = config.num_nextn_predict_layers, config.num_hidden_layers
    ref = next(target.parameters())
    with torch.device("meta"):
        mtp = MultiTokenPredictor(target, n, config)
    mtp = mtp.to(ref.dtype).to_empty(device=ref.device)
    params = dict(mtp.named_parameters())
    filled = dict.fromkeys(params, 0)
    packer = SimpleNamespace(config=config, lm_head=None)  # what load_tensor reads of its model
    embeds: list[torch.Tensor] = []
    heads: dict[int, torch.Tensor] = {}
    for i, rest, tensor in _mtp_tensors(Path(path), first, n):
        if rest == "embed_tokens.weight":
            embeds.append(tensor)
        elif rest == "shared_head.head.weight":
            heads[i] = tensor
        else:
            own = rest.startswith(_OWN)
            name = f"layers.{i}.{rest}" if own else f"layers.{i}.mtp_block.{rest}"
            try:
                LlamaForCausalLM.load_tensor(packer, name, tensor, params, filled)
            except ValueError as e:
                raise ValueError(f"MTP layer {first + i} in {path}: {e}") from None
    missing = [k for k, p in params.items() if filled[k] != p.numel()]
    if missing:
        raise ValueError(
            f"{path}: MTP layers {first}..{first + n - 1} lack (or repeat) tensors, e.g. "
            f"{missing[:3]} (num_nextn_predict_layers = {n})"
        )
    _attach_shared(mtp, embeds, heads, path)
    return mtp.eval().requires_grad_(False)


def _mtp_tensors(path: Path, first: int, n: int) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(MTP layer index i, name after its prefix, tensor) for every tensor of layers
    first .. first + n - 1 in the directory's safetensors files."""
    from safetensors import safe_open

    prefixes = [f"model.layers.{first + i}." for i in range(n)]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                for i, prefix in enumerate(prefixes):
                    if name.startswith(prefix):
                        yield i, name.removeprefix(prefix), f.get_tensor(name)


def _attach_shared(
    mtp: MultiTokenPredictor,
    embeds: list[torch.Tensor],
    heads: dict[int, torch.Tensor],
    path: str | Path,
) -> None:
    """Share the target's embedding and LM head where the checkpoint's copies equal them;
    keep a copy that differs as the predictor's own (one embedding, one head per layer)."""
    target, c = mtp.target, mtp.config
    ref = next(target.parameters())
    shape = (c.vocab_size, c.hidden_size)
    for tensor in [*embeds, *heads.values()]:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{path}: MTP embedding / head of shape {tuple(tensor.shape)}")
    target_embed = target.model.embed_tokens.weight
    target_head = (target.lm_head or target.model.embed_tokens).weight
    if embeds and not torch.equal(embeds[0].to(ref), target_embed):
        embed = nn.Embedding(*shape, device=ref.device, dtype=ref.dtype)
        embed.weight.data.copy_(embeds[0])
        mtp.embed_tokens = embed
        logger.info("%s: the MTP layers' embedding differs from the target's; kept apart", path)
    for i, tensor in heads.items():
        if not torch.equal(tensor.to(ref), target_head):
            head = nn.Linear(*shape[::-1], bias=False, device=ref.device, dtype=ref.dtype)
            head.weight.data.copy_(tensor)
            mtp.layers[i].shared_head.head = head
            logger.info("%s: MTP layer %d's head differs from the target's; kept apart", path, i)
