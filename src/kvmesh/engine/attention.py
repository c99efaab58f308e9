"""Paged attention over a block-structured KV cache (device agnostic: plain torch ops + SDPA).

Cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], K at
index 0 and V at index 1. Flat slot s = block_id * block_size + offset. Every cache entry is
finite at all times (zero-initialised, then only overwritten with computed K/V): padded gathers
read arbitrary blocks and mask them out, and a masked NaN would still poison SDPA's output.

A step's tokens are flat; sequence s owns query_lens[s] consecutive tokens, the first at position
context_lens[s] - query_lens[s]. Decode rows (query_len == 1) of a step are batched through one
padded gather + SDPA; longer rows (prefill chunks) run one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvmesh.engine.models.llama import ModelConfig


@dataclass(slots=True)
class _DecodePlan:
    rows: torch.Tensor | None  # flat token index of each decode row; None when every row decodes
    flat_blocks: torch.Tensor  # [D * nb] block ids, each row's table trimmed to nb blocks
    mask: torch.Tensor  # [D, 1, 1, nb * block_size] bool: key position < context length
    num_blocks: int  # nb


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 flat slot where each scheduled token's K/V is written
    query_lens: list[int]  # tokens scheduled per sequence; contiguous in the flat batch; sum == T
    context_lens: list[int]  # tokens of each sequence in the cache after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    # Derived in __post_init__; the plan is built on the first layer and reused by the others.
    query_starts: list[int] = field(init=False)  # len num_seqs + 1, prefix sums of query_lens
    is_pure_decode: bool = field(init=False)
    max_context_len: int = field(init=False)
    _decode: _DecodePlan | None = field(init=False, default=None)
    _prefill_masks: dict[int, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        assert len(self.query_lens) == len(self.context_lens) == self.block_tables.shape[0]
        starts = [0]
        for n, ctx in zip(self.query_lens, self.context_lens, strict=True):
            assert 0 < n <= ctx, "each sequence schedules at least one token"
            starts.append(starts[-1] + n)
        assert starts[-1] == self.slot_mapping.shape[0]
        self.query_starts = starts
        self.is_pure_decode = all(n == 1 for n in self.query_lens)
        self.max_context_len = max(self.context_lens, default=0)

    @classmethod
    def build(
        cls,
        slots: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        width = max((len(t) for t in block_tables), default=0)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def decode_plan(self, block_size: int) -> _DecodePlan | None:
        if self._decode is None:
            seqs = [s for s, n in enumerate(self.query_lens) if n == 1]
            if not seqs:
                return None
            dev = self.block_tables.device
            ctx = torch.tensor([self.context_lens[s] for s in seqs], device=dev)
            nb = -(-max(self.context_lens[s] for s in seqs) // block_size)
            tables = self.block_tables[:, :nb]
            rows = None
            if not self.is_pure_decode:
                tables = tables[torch.tensor(seqs, device=dev)]
                rows = torch.tensor([self.query_starts[s] for s in seqs], device=dev)
            keys = torch.arange(nb * block_size, device=dev)
            mask = (keys[None, :] < ctx[:, None]).view(len(seqs), 1, 1, -1)
            self._decode = _DecodePlan(rows, tables.reshape(-1), mask, nb)
        return self._decode

    def prefill_mask(self, seq: int) -> torch.Tensor:
        """[n, ctx] bool: query i (position ctx - n + i) sees keys at positions <= its own."""
        mask = self._prefill_masks.get(seq)
        if mask is None:
            n, ctx = self.query_lens[seq], self.context_lens[seq]
            dev = self.block_tables.device
            qpos = torch.arange(ctx - n, ctx, device=dev)
            mask = torch.arange(ctx, device=dev)[None, :] <= qpos[:, None]
            self._prefill_masks[seq] = mask
        return mask


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    per_layer = 2 * block_size * model_config.num_key_value_heads * model_config.head_dim
    return per_layer * model_config.num_hidden_layers * dtype.itemsize


def allocate_kv_cache(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
    # zeros, not empty: see the module docstring on finite cache contents
    return [
        torch.zeros(shape, device=device, dtype=dtype)
        for _ in range(model_config.num_hidden_layers)
    ]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    kvh, hd = kv_cache.shape[-2:]
    kv_cache[0].view(-1, kvh, hd).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, kvh, hd).index_copy_(0, slots, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, hd], k/v [T, kv_heads, hd] for this step's tokens -> [T, heads, hd].

    Writes k/v into the cache at meta.slot_mapping first, so every query sees its own token.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    block_size = kv_cache.shape[2]
    plan = meta.decode_plan(block_size)
    if meta.is_pure_decode:
        assert plan is not None
        return _decode(q, kv_cache, plan, scale)
    out = torch.empty_like(q)
    if plan is not None:
        assert plan.rows is not None
        out.index_copy_(0, plan.rows, _decode(q.index_select(0, plan.rows), kv_cache, plan, scale))
    for s, n in enumerate(meta.query_lens):
        if n == 1:
            continue
        start, ctx = meta.query_starts[s], meta.context_lens[s]
        qs = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
        if ctx == n:  # nothing cached before this chunk: attend to the fresh K/V, plain causal
            ks, vs = k[start : start + n], v[start : start + n]
            mask, causal = None, True
        else:
            nb = -(-ctx // block_size)
            blocks = meta.block_tables[s, :nb]
            ks = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:ctx]
            vs = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:ctx]
            mask, causal = meta.prefill_mask(s), False
        o = F.scaled_dot_product_attention(
            qs,
            ks.to(q.dtype).transpose(0, 1).unsqueeze(0),
            vs.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + n] = o[0].transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float
) -> torch.Tensor:
    """One query per row: gather each row's blocks into a padded [D, kvh, L, hd] and run SDPA.

    GQA without repeating K/V: the heads sharing a KV head become that head's query rows.
    """
    d, heads, hd = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    length = plan.num_blocks * block_size
    k = kv_cache[0].view(kv_cache.shape[1], -1).index_select(0, plan.flat_blocks)
    v = kv_cache[1].view(kv_cache.shape[1], -1).index_select(0, plan.flat_blocks)
    k = k.view(d, length, kvh, hd).transpose(1, 2).to(q.dtype)
    v = v.view(d, length, kvh, hd).transpose(1, 2).to(q.dtype)
    qg = q.view(d, kvh, heads // kvh, hd)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask, scale=scale)
    return o.reshape(d, heads, hd)
