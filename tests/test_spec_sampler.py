"""The engine sampler's verification of drafts: greedy is the argmax chain; sampled output
keeps the distribution the sampler gives without drafts (temperature and top-k applied)."""

from __future__ import annotations

import torch

from kvmesh.engine.sampler import Sampler
from kvmesh.engine.sequence import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 2.5, 0.5, 1.0, 0.0, 0.0], [1.0] * 6])


def test_greedy_verify_is_the_argmax_chain():
    s = Sampler()
    greedy = SamplingParams(temperature=0, logprobs=1)
    tokens, logprobs = s.verify(LOGITS.clone(), [0, 1], "r", greedy)
    assert tokens == [0, 1, 0]  # both drafts accepted, then the bonus argmax
    assert len(logprobs) == 3 and logprobs[0][0][0] == 0
    assert s.verify(LOGITS.clone(), [3, 1], "r", greedy)[0] == [0]  # first draft rejected
    assert s.verify(LOGITS.clone(), [0, 4], "r", greedy)[0] == [0, 1]


def test_sampled_first_token_keeps_the_filtered_distribution():
    params = SamplingParams(temperature=0.8, top_k=4, seed=7)
    s = Sampler()
    n = 4000
    counts = torch.zeros(6)
    for _ in range(n):  # draft token 1 (not the target's favourite) at position 0
        counts[s.verify(LOGITS.clone(), [1, 1], "r", params)[0][0]] += 1
    row = LOGITS[0] / 0.8
    row[row < torch.topk(row, 4).values[-1]] = float("-inf")
    expected = torch.softmax(row, dim=-1) * n
    keep = expected > 0
    assert counts[~keep].sum() == 0  # top-k holds with drafts too
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert stat < 16.3  # chi-square, 3 dof, p = 0.001
    # accepting the draft whenever the target gives it some mass would fail this test
    biased = expected.clone()
    biased[1] = n
    assert float(((counts[keep] - biased[keep]) ** 2 / biased[keep]).sum()) > 16.3
