"""Verification: greedy equals plain greedy decoding; sampling keeps the target distribution.

The statistical tests decode 3 tokens from a bigram "target" T[prev] with a bigram "drafter"
D[prev], speculating k tokens per step, for many rows in parallel with a fixed seed, and compare
the joint distribution of the 3 tokens with the target's exact one by a chi-square test at
p = 0.001. A biased rule (accept any draft the target gives more than 0.1) fails the same test.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.engine.spec.rejection import (
    PLACEHOLDER_TOKEN_ID,
    greedy_verify,
    rejection_sample,
)

V, LENGTH, ROWS = 4, 3, 20_000


def test_greedy_examples() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 4, 4]])
    n = torch.tensor([3, 3, 3, 1])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [0, 2, 3, 8], [4, 1, 1, 1]])
    out = greedy_verify(drafts, n, argmax)
    assert out.num_accepted.tolist() == [3, 1, 0, 1]
    p = PLACEHOLDER_TOKEN_ID
    assert out.output_token_ids.tolist() == [
        [5, 6, 7, 8],  # all accepted + bonus
        [5, 6, p, p],  # mismatch at 1: the target's token there
        [0, p, p, p],
        [4, 1, p, p],  # one real draft: accepted, then the bonus at position 1
    ]


def test_greedy_equals_sequential_decoding() -> None:
    gen = torch.Generator().manual_seed(0)
    b, k = 64, 4
    argmax = torch.randint(0, 3, (b, k + 1), generator=gen)
    drafts = torch.where(torch.rand(b, k, generator=gen) < 0.7, argmax[:, :k], 3)
    n = torch.randint(0, k + 1, (b,), generator=gen)
    out = greedy_verify(drafts, n, argmax)
    for r in range(b):
        want = []
        for j in range(n[r] + 1):  # what one-token-per-step greedy emits until it diverges
            want.append(int(argmax[r, j]))
            if j == n[r] or drafts[r, j] != argmax[r, j]:
                break
        got = [t for t in out.output_token_ids[r].tolist() if t != PLACEHOLDER_TOKEN_ID]
        assert got == want
        assert int(out.num_accepted[r]) == len(want) - 1


def test_zero_drafts_sample_from_the_target() -> None:
    probs = torch.tensor([[[0.0, 1.0, 0.0]]]).expand(5, 1, 3)
    out = rejection_sample(torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, dtype=torch.long),
                           probs)  # fmt: skip
    assert out.output_token_ids.tolist() == [[1]] * 5
    assert out.num_accepted.tolist() == [0] * 5


def test_bad_shapes_are_refused() -> None:
    d = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="K \\+ 1"):
        greedy_verify(d, torch.tensor([3, 3]), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="num_draft_tokens must be <= K"):
        greedy_verify(d, torch.tensor([4, 0]), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
        greedy_verify(d, torch.tensor([-1, 0]), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(d, torch.tensor([3, 3]), torch.ones(2, 4, 5), torch.ones(2, 3, 6))


# --- lossless sampling ---------------------------------------------------------------------

TARGET = torch.tensor(
    [[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.3, 0.1, 0.4, 0.2], [0.25, 0.25, 0.1, 0.4]]
)
DRAFT = torch.tensor(  # deliberately unlike the target
    [[0.1, 0.1, 0.7, 0.1], [0.4, 0.1, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]
)
START = 0


def biased_sample(drafts, n, target_probs, draft_probs, generator):
    """The wrong rule: accept a draft whenever the target gives it more than 0.1."""
    b, k = drafts.shape
    p_draft = target_probs[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
    ok = (p_draft > 0.1) & (torch.arange(k)[None, :] < n[:, None])
    accepted = ok.long().cumprod(1).sum(1)
    dist = target_probs[torch.arange(b), accepted]
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    out = torch.cat((drafts, drafts[:, :1]), 1)
    out = torch.where(torch.arange(k + 1)[None, :] < accepted[:, None], out, PLACEHOLDER_TOKEN_ID)
    out[torch.arange(b), accepted] = last
    return out, accepted


def speculative_decode(verify, k: int, deterministic: bool, seed: int) -> torch.Tensor:
    """ROWS independent 3-token decodes; returns [ROWS, LENGTH] tokens."""
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    lens = torch.zeros(ROWS, dtype=torch.long)
    prev = torch.full((ROWS,), START)
    rows = torch.arange(ROWS)
    while int(lens.min()) < LENGTH:
        drafts, ctx = [], prev
        for _ in range(k):
            if deterministic:  # an n-gram-like drafter: a fixed guess per context
                d = (ctx + 1) % V
            else:
                d = torch.multinomial(DRAFT[ctx], 1, generator=gen).squeeze(1)
            drafts.append(d)
            ctx = d
        drafts_t = torch.stack(drafts, 1)
        contexts = torch.cat((prev[:, None], drafts_t), 1)  # position j's previous token
        target_probs = TARGET[contexts]  # [ROWS, k + 1, V]
        draft_probs = None if deterministic else DRAFT[contexts[:, :k]]
        out = verify(drafts_t, torch.full((ROWS,), k), target_probs, draft_probs, gen)
        tokens, accepted = out  # a VerifyOutput or the biased rule's pair
        for j in range(k + 1):  # append the a + 1 emitted tokens, up to LENGTH
            put = (j <= accepted) & (lens + j < LENGTH)
            seqs[rows[put], (lens + j)[put]] = tokens[put, j]
        prev = tokens[rows, accepted]
        lens = lens + accepted + 1
    return seqs


def chi_square_vs_target(samples: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001) over the V**LENGTH joint outcomes."""
    codes = (samples * torch.tensor([V * V, V, 1])).sum(1)
    counts = torch.bincount(codes, minlength=V**LENGTH).double()
    expected = torch.empty(V**LENGTH, dtype=torch.double)
    for c in range(V**LENGTH):
        a, b, d = c // (V * V), c // V % V, c % V
        expected[c] = float(TARGET[START, a] * TARGET[a, b] * TARGET[b, d]) * len(samples)
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = V**LENGTH - 1
    z = 3.0902  # Wilson-Hilferty approximation of the chi-square 0.999 quantile
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, crit


@pytest.mark.parametrize(("k", "deterministic"), [(2, False), (3, True)])
def test_rejection_sampling_keeps_the_target_distribution(k: int, deterministic: bool) -> None:
    stat, crit = chi_square_vs_target(speculative_decode(rejection_sample, k, deterministic, 1))
    assert stat < crit, (stat, crit)
    biased, _ = chi_square_vs_target(speculative_decode(biased_sample, k, deterministic, 1))
    assert biased > crit, (biased, crit)


def test_acceptance_metrics_as_vllm_exports_them() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvmesh.engine.spec.metrics import SpecDecodingProm

    registry = CollectorRegistry()
    prom = SpecDecodingProm(registry, {"model_name": "m", "engine": "0"}, 3)
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 4, 4]])
    n = torch.tensor([3, 3, 3, 1])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [0, 2, 3, 8], [4, 1, 1, 1]])
    out = greedy_verify(drafts, n, argmax)
    prom.record(zip(n.tolist(), out.num_accepted.tolist(), strict=True))
    s = prom.stats.summary()
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 10, 5)
    assert s.acceptance_rate == 0.5 and s.mean_acceptance_length == 1 + 5 / 4
    assert s.per_position_acceptance_rate == [3 / 4, 1 / 4, 1 / 4]
    text = generate_latest(registry).decode()
    labels = 'engine="0",model_name="m"'
    for line in (
        f"vllm:spec_decode_num_drafts_total{{{labels}}} 4.0",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 10.0",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 5.0",
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 3.0',
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="2"}} 1.0',
    ):
        assert line in text, line
    with pytest.raises(ValueError, match="accepted"):
        prom.record([(2, 3)])
