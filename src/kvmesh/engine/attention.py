"""Paged attention over a block-structured KV cache (device agnostic: plain torch ops + SDPA).

Cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], K at
index 0 and V at index 1. Flat slot s = block_id * block_size + offset. Every cache entry is
finite at all times (zero-initialised, then only overwritten with computed K/V): padded gathers
read arbitrary blocks and mask them out, and a masked NaN would still poison SDPA's output.

A step's tokens are flat; sequence s owns query_lens[s] consecutive tokens, the first at position
context_lens[s] - query_lens[s]. Short rows (up to SHORT_QUERY tokens: decodes, and a decode
with its speculative drafts) are batched through one padded gather of each sequence's blocks +
one SDPA, with a sequence's queries padded to the longest short row and each query masked to the
keys up to its position; longer rows (prefill chunks) run one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvmesh.engine.models.model_config import ModelConfig

# a sequence with at most this many query tokens joins the batched decode path: a verify step's
# k + 1 rows then cost about one decode batch, where an SDPA call per sequence costs several
# times more on CPU
SHORT_QUERY = 8


@dataclass(slots=True)
class _DecodePlan:
    """S short sequences, each with up to N queries: padded query p = s * N + i is the
    sequence's query min(i, n_s - 1) (a padded copy repeats the last and is dropped)."""

    padded: torch.Tensor | None  # [S * N] flat token of each padded query; None: identity
    rows: torch.Tensor | None  # flat token of each real query, in order; None: all T in order
    real: torch.Tensor | None  # [R] index of each real query among the S * N; None: all
    flat_blocks: torch.Tensor  # [S * nb] block ids, each sequence's table trimmed to nb blocks
    key_limit: torch.Tensor  # [S, N] keys each padded query sees (positions < its limit)
    num_blocks: int  # nb
    width: int  # N
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # group size -> SDPA mask

    def mask(self, group: int, block_size: int) -> torch.Tensor:
        """[S, 1, group * N, nb * block_size] bool, query heads grouped per KV head (GQA)."""
        m = self.masks.get(group)
        if m is None:
            keys = torch.arange(self.num_blocks * block_size, device=self.key_limit.device)
            m = keys[None, None, :] < self.key_limit[:, :, None]  # [S, N, L]
            s, n, length = m.shape
            m = m[:, None].expand(s, group, n, length).reshape(s, 1, group * n, length)
            self.masks[group] = m
        return m


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 flat slot where each scheduled token's K/V is written
    query_lens: list[int]  # tokens scheduled per sequence; contiguous in the flat batch; sum == T
    context_lens: list[int]  # tokens of each sequence in the cache after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    # Derived in __post_init__; the plan is built on the first layer and reused by the others.
    query_starts: list[int] = field(init=False)  # len num_seqs + 1, prefix sums of query_lens
    is_pure_decode: bool = field(init=False)  # every sequence is short (<= SHORT_QUERY)
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
        self.is_pure_decode = all(n <= SHORT_QUERY for n in self.query_lens)
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
            short = [s for s, n in enumerate(self.query_lens) if n <= SHORT_QUERY]
            if not short:
                return None
            width = max(self.query_lens[s] for s in short)
            padded, limits, rows, real = [], [], [], []
            for j, s in enumerate(short):
                n, start, ctx = self.query_lens[s], self.query_starts[s], self.context_lens[s]
                for i in range(width):
                    q = min(i, n - 1)
                    padded.append(start + q)
                    limits.append(ctx - n + q + 1)  # query q is at position ctx - n + q
                    if i < n:
                        rows.append(start + i)
                        real.append(j * width + i)
            dev = self.block_tables.device
            nb = -(-max(self.context_lens[s] for s in short) // block_size)
            tables = self.block_tables[:, :nb]
            if len(short) != self.num_seqs:
                tables = tables[torch.tensor(short, device=dev)]
            every_row = self.is_pure_decode  # then the real queries are all T, in order
            self._decode = _DecodePlan(
                padded=None if width == 1 and every_row else torch.tensor(padded, device=dev),
                rows=None if every_row else torch.tensor(rows, device=dev),
                real=None if width == 1 else torch.tensor(real, device=dev),
                flat_blocks=tables.reshape(-1),
                key_limit=torch.tensor(limits, device=dev).view(len(short), width),
                num_blocks=nb,
                width=width,
            )
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
        out.index_copy_(0, plan.rows, _decode(q, kv_cache, plan, scale))
    for s, n in enumerate(meta.query_lens):
        if n <= SHORT_QUERY:
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
    """The plan's real queries, in order: each sequence's blocks gathered once into a padded
    [S, kvh, L, hd], its N queries and the heads sharing a KV head as that head's query rows
    (GQA without repeating K/V), one SDPA over all."""
    _, heads, hd = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    group, width = heads // kvh, plan.width
    s = plan.key_limit.shape[0]
    length = plan.num_blocks * block_size
    k = kv_cache[0].view(kv_cache.shape[1], -1).index_select(0, plan.flat_blocks)
    v = kv_cache[1].view(kv_cache.shape[1], -1).index_select(0, plan.flat_blocks)
    k = k.view(s, length, kvh, hd).transpose(1, 2).to(q.dtype)
    v = v.view(s, length, kvh, hd).transpose(1, 2).to(q.dtype)
    if plan.padded is not None:
        q = q.index_select(0, plan.padded)
    qg = q.view(s, width, kvh, group, hd).permute(0, 2, 3, 1, 4).reshape(s, kvh, group * width, hd)
    mask = plan.mask(group, block_size)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    o = o.view(s, kvh, group, width, hd).permute(0, 3, 1, 2, 4).reshape(s * width, heads, hd)
    return o if plan.real is None else o.index_select(0, plan.real)
