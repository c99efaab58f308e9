"""Paged attention equals dense causal attention for any mix of decodes, short multi-query rows
(a decode with its drafts) and prefill chunks, whatever the blocks' order in the cache."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.attention import SHORT_QUERY, AttentionMetadata, paged_attention

HEADS, KV_HEADS, HD, BS, NUM_BLOCKS = 6, 2, 8, 4, 64


def dense(q, k, v, scale):
    """q [n, h, d] at the last n of ctx positions; k/v [ctx, kvh, d]."""
    n, ctx = q.shape[0], k.shape[0]
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos = torch.arange(ctx - n, ctx)
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 2 * SHORT_QUERY)), min_size=1, max_size=5
    ),
    st.integers(0, 2**16),
)
def test_paged_equals_dense(seqs, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, BS, KV_HEADS, HD, generator=gen)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    slots, qlens, clens, tables, qs, ks, vs, refs = [], [], [], [], [], [], [], []
    for cached, n in seqs:
        ctx = cached + n
        table = [free.pop() for _ in range(-(-ctx // BS))]
        k = torch.randn(ctx, KV_HEADS, HD, generator=gen)
        v = torch.randn(ctx, KV_HEADS, HD, generator=gen)
        for p in range(cached):  # the cached prefix, already in its blocks
            cache[0, table[p // BS], p % BS], cache[1, table[p // BS], p % BS] = k[p], v[p]
        q = torch.randn(n, HEADS, HD, generator=gen)
        slots += [table[p // BS] * BS + p % BS for p in range(cached, ctx)]
        qlens.append(n), clens.append(ctx), tables.append(table)
        qs.append(q), ks.append(k[cached:]), vs.append(v[cached:])
        refs.append(dense(q, k, v, HD**-0.5))
    meta = AttentionMetadata.build(slots, qlens, clens, tables)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, HD**-0.5)
    torch.testing.assert_close(out, torch.cat(refs), rtol=1e-4, atol=1e-5)
