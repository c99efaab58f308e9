"""Prompt lookup against a brute-force scan: longest suffix n-gram, most recent occurrence."""

from __future__ import annotations

import random

import pytest

from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.ngram import NgramIndex, NgramProposer


def brute_force(s: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest n in [lo, hi] first; for it, the latest start j with s[j:j+n] == suffix, j+n < L."""
    length = len(s)
    for n in range(hi, lo - 1, -1):
        if n >= length:
            continue
        suffix = s[length - n :]
        for j in range(length - n - 1, -1, -1):
            if s[j : j + n] == suffix:
                return s[j + n : j + n + k]
    return []


def test_examples() -> None:
    idx = NgramIndex(2, 3)
    idx.extend([1, 2, 3, 4, 9, 2, 3, 4, 7, 8, 2, 3])
    # suffix [2, 3]: 3-gram [8, 2, 3] never occurred; [2, 3] last occurred at 5..7 -> [4, 7, 8]
    assert idx.propose(3) == [4, 7, 8]
    idx.extend([4])
    # suffix [2, 3, 4] occurred at 1..4 and 5..8: the most recent continues [7, 8, 2]
    assert idx.propose(3) == [7, 8, 2]
    assert idx.propose(10) == [7, 8, 2, 3, 4]  # the sequence ends: fewer than k
    # repeating pattern: the match may overlap the suffix
    rep = NgramIndex(1, 2)
    rep.extend([5, 5, 5])
    assert rep.propose(4) == [5]
    assert NgramIndex(3, 4).propose(2) == []
    short = NgramIndex(3, 3)
    short.extend([1, 2, 3])
    assert short.propose(2) == []  # the suffix itself is not an earlier occurrence


@pytest.mark.parametrize(("lo", "hi", "vocab"), [(1, 1, 3), (2, 4, 4), (3, 5, 6), (1, 6, 2)])
def test_matches_brute_force_token_by_token(lo: int, hi: int, vocab: int) -> None:
    rng = random.Random(lo * 100 + hi * 10 + vocab)
    for _ in range(20):
        s = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        idx = NgramIndex(lo, hi)
        for t in range(len(s)):
            idx.extend(s[t : t + 1])
            k = rng.randrange(1, 6)
            assert idx.propose(k) == brute_force(s[: t + 1], lo, hi, k), (s[: t + 1], k)


def test_proposer_tracks_requests_incrementally_and_restarts() -> None:
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
    )  # fmt: skip
    p = NgramProposer.from_config(cfg)
    rng = random.Random(7)
    a = [rng.randrange(5) for _ in range(40)]
    b = [rng.randrange(5) for _ in range(30)]
    for t in range(10, 41, 3):  # verified tokens arrive a few at a time, interleaved
        assert p.propose("a", a[:t]) == brute_force(a[:t], 2, 4, 3)
        assert p.propose("b", b[: t - 10]) == brute_force(b[: t - 10], 2, 4, 3)
    assert p.propose("a", a, max_tokens=1) == brute_force(a, 2, 4, 1)
    assert p.propose("a", a, max_tokens=0) == []
    assert p.propose("a", a[:12]) == brute_force(a[:12], 2, 4, 3)  # shorter: rebuilt
    assert len(p) == 2
    p.forget("a")
    p.forget("missing")
    assert len(p) == 1


def test_long_context_is_indexed_once() -> None:
    """An edit-style request: a 20k-token prompt the output copies; each step reads only the
    new tokens, and the copied span is proposed in full."""
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(20_000)]
    p = NgramProposer(5, 3, 5)
    assert p.propose("r", prompt) == brute_force(prompt, 3, 5, 5)
    out = prompt[:0]
    seq = list(prompt)
    for t in range(100):  # the model copies prompt[1000:1100]
        seq.append(prompt[1000 + t])
        out = p.propose("r", seq)
        if t >= 2:
            assert out == prompt[1001 + t : 1006 + t]
    assert p._indexes["r"].tokens == seq


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(0, 3)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 4, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0, 1, 2)
