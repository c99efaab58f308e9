"""Acceptance of an MTP head measured offline, with the same chaining as at inference.

A Sample is one sequence the target has already produced (prompt + its greedy answer) with the
target's final hidden state and argmax at every position. For every answer position i the head
drafts k tokens: depth 1 reads (t_{i+1}, h_i); depth d > 1 is a decode row at position i + d - 1
reading (draft d - 1, g from depth d - 1) and attending to depth 1's cache rows 0..i plus its
own chain. Block size 1 lets every chain share depth 1's rows and own private slots, so all
chains of a sequence run as one batch per depth. Draft d is accepted when it and every draft
before it equal the target's argmax: the same per-position count vLLM exports.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.models.llama import LlamaForCausalLM
from kvmesh.engine.spec.mtp import MultiTokenPredictor


class Sample(NamedTuple):
    tokens: list[int]  # prompt + answer
    hidden: torch.Tensor  # [T, H] target's final hidden state (after its norm) per position
    argmax: torch.Tensor  # [T] target's greedy next token after each position
    prompt_len: int


class Acceptance(NamedTuple):
    num_drafts: int  # chains measured (one per answer position with k tokens after it)
    accepted_per_pos: list[float]  # P(drafts 1..d all accepted), d = 1..k
    conditional_per_pos: list[float]  # P(draft d accepted | drafts 1..d-1 accepted)
    top1_per_pos: list[float]  # P(draft d equals the target's token), chain ignored
    mean_acceptance_length: float  # 1 + expected accepted drafts: tokens per target pass


@torch.inference_mode()
def target_pass(model: LlamaForCausalLM, tokens: list[int], prompt_len: int) -> Sample:
    """One whole-sequence pass of the target (block size 1 cache, dropped afterwards)."""
    n = len(tokens)
    caches = allocate_kv_cache(model.config, n, 1, "cpu", next(model.parameters()).dtype)
    meta = AttentionMetadata.build(list(range(n)), [n], [n], [list(range(n))])
    hidden = model(torch.tensor(tokens), torch.arange(n), caches, meta)
    return Sample(list(tokens), hidden.float(), model.compute_logits(hidden).argmax(-1), prompt_len)


@torch.inference_mode()
def greedy_sample(
    model: LlamaForCausalLM, prompt: list[int], max_new: int, eos: tuple[int, ...] = ()
) -> Sample:
    """Greedy decoding of one sequence (prefill, then one token per pass), keeping every
    computed position's hidden state and argmax; the last token sampled is not in the Sample."""
    total = len(prompt) + max_new
    caches = allocate_kv_cache(model.config, total, 1, "cpu", next(model.parameters()).dtype)
    tokens, hidden, top, done = list(prompt), [], [], 0
    for _ in range(max_new):
        new = list(range(done, len(tokens)))
        meta = AttentionMetadata.build(new, [len(new)], [len(tokens)], [list(range(len(tokens)))])
        h = model(torch.tensor(tokens[done:]), torch.tensor(new), caches, meta)
        hidden.append(h.float())
        top.append(model.compute_logits(h).argmax(-1))
        done = len(tokens)
        tokens.append(int(top[-1][-1]))
        if tokens[-1] in eos:
            break
    return Sample(tokens[:done], torch.cat(hidden), torch.cat(top), len(prompt))


@torch.inference_mode()
def chain_drafts(mtp: MultiTokenPredictor, s: Sample, k: int) -> tuple[list[int], torch.Tensor]:
    """(chain start rows i, drafts [len(starts), k]) for every answer position of `s`."""
    n = len(s.tokens) - 1  # depth-1 rows 0..T-2
    starts = list(range(s.prompt_len - 1, len(s.tokens) - 1 - k))
    if not starts:
        return [], torch.zeros(0, k, dtype=torch.long)
    c = mtp.config
    cache = allocate_kv_cache(c, n + len(starts) * (k - 1), 1, "cpu", s.hidden.dtype)[0]
    table = list(range(n))
    meta = AttentionMetadata.build(table, [n], [n], [table])
    g = mtp(torch.tensor(s.tokens[1:]), torch.arange(n), s.hidden[:n], cache, meta, depth=1)
    rows = torch.tensor(starts)
    g = g[rows]
    drafts = [mtp.compute_logits(g, 1).argmax(-1)]
    for depth in range(2, k + 1):
        own = [[n + j * (k - 1) + d for d in range(depth - 1)] for j in range(len(starts))]
        tables = [table[: i + 1] + o for i, o in zip(starts, own, strict=True)]
        meta = AttentionMetadata.build(
            [o[-1] for o in own], [1] * len(starts), [len(t) for t in tables], tables
        )
        g = mtp(drafts[-1], rows + depth - 1, g, cache, meta, depth=depth)
        drafts.append(mtp.compute_logits(g, depth).argmax(-1))
    return starts, torch.stack(drafts, dim=1)


def acceptance_per_position(mtp: MultiTokenPredictor, samples: list[Sample], k: int) -> Acceptance:
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    hits, cum = torch.zeros(k), torch.zeros(k)
    total = 0
    for s in samples:
        starts, drafts = chain_drafts(mtp, s, k)
        if not starts:
            continue
        rows = torch.tensor(starts)
        # draft d of the chain at row i predicts the target's argmax at row i + d
        want = torch.stack([s.argmax[rows + d] for d in range(1, k + 1)], dim=1)
        ok = drafts == want
        hits += ok.sum(0)
        cum += ok.cumprod(dim=1).sum(0)
        total += len(starts)
    if total == 0:
        raise ValueError("no answer position has k tokens after it")
    accepted = (cum / total).tolist()
    conditional = [accepted[0]] + [
        a / b if b else 0.0 for a, b in zip(accepted[1:], accepted[:-1], strict=True)
    ]
    return Acceptance(
        num_drafts=total,
        accepted_per_pos=[round(a, 4) for a in accepted],
        conditional_per_pos=[round(a, 4) for a in conditional],
        top1_per_pos=[round(a, 4) for a in (hits / total).tolist()],
        mean_acceptance_length=round(1.0 + sum(accepted), 4),
    )
