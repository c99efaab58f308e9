"""The emulated decode step's fast paths give what the per-token definitions give: a run of the
output stream is its tokens position by position (across the filler's wrap), a model drafter's
drafts are the stream's next tokens, and its acceptance draws one number per position until the
first rejection, as many as a position-by-position loop with the same seed draws."""

from __future__ import annotations

import random

from kvmesh.engine.emulation.latency import ConstantLatency
from kvmesh.engine.emulation.runner import EmulatedRunner
from kvmesh.engine.emulation.spec import Acceptance, EmulatedDrafter
from kvmesh.engine.sequence import Request, SamplingParams


def _runner(tokenizer) -> EmulatedRunner:
    return EmulatedRunner(ConstantLatency(0.01, 0.005), 64, 16, 1024, tokenizer)


def test_a_run_of_the_stream_is_its_tokens_one_position_at_a_time(tokenizer) -> None:
    runner = _runner(tokenizer)
    n = len(runner.filler)
    request = Request("r", [5, 9, 200, 31, 7], SamplingParams(max_tokens=4 * n))
    for first in (0, 1, n - 3, n - 1, n, 2 * n + 5):
        for count in (1, 2, 4, n - 1, n, n + 3, 2 * n + 1):
            one_by_one = [runner.stream_token(request, first + j) for j in range(count)]
            assert runner.stream_tokens(request, first, count) == one_by_one


def test_model_drafts_are_the_streams_next_tokens(tokenizer) -> None:
    runner = _runner(tokenizer)
    drafter = EmulatedDrafter(runner.stream_tokens)
    requests = [
        Request(f"r{i}", [i, i + 1, i + 2], SamplingParams(max_tokens=99)) for i in range(3)
    ]
    requests[1].output_token_ids += [1, 2, 3, 4]
    drafts = drafter.propose(requests, [3, 1, 2])
    for request, got, k in zip(requests, drafts, [3, 1, 2], strict=True):
        first = len(request.output_token_ids)
        assert got == [runner.stream_token(request, first + j) for j in range(k)]


def test_model_acceptance_draws_as_a_position_by_position_loop() -> None:
    rates = (0.8, 0.7, 0.6)
    fast = Acceptance("mtp", rates, seed=(0, 3, 1))
    rng = random.Random(str((0, 3, 1)))  # the same seed, drawn by the definition
    counts = []
    for step in range(2000):
        k = step % 5  # 0 to 4 drafts, past the rates' length too
        expected = 0
        while expected < k and rng.random() < rates[min(expected, len(rates) - 1)]:
            expected += 1
        got = fast.num_drawn(k) if step % 2 else fast.num_accepted([0] * k, lambda j: 0)
        assert got == expected
        counts.append(got)
    assert 0 < sum(counts) < 2 * len(counts)
