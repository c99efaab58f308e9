"""Expert load accounting and EPLB: rebalancing lowers the imbalance of a skewed routing
distribution and leaves the model's outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.models.eplb import (
    EplbState,
    apply_placement,
    expert_load,
    rank_loads,
    rebalance,
    rebalance_model,
)
from kvmesh.engine.models.expert_parallel import ExpertParallelConfig, initial_placement
from kvmesh.engine.models.loader import load_model
from tests.test_model_hf import PagedLoop
from tests.test_moe_model import save_tiny

RANKS = 4  # slots viewed as split over 4 EP ranks
REDUNDANT = 4  # 8 experts + 4 redundant = 12 slots, 3 per rank


def imbalance(loads: list[float]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def test_rebalance_skewed_distribution() -> None:
    load = [int(10_000 / (e + 1) ** 1.5) for e in range(16)]  # Zipf-like: expert 0 is hot
    ep = ExpertParallelConfig(0, RANKS, object(), num_redundant_experts=REDUNDANT)  # type: ignore[arg-type]
    before = initial_placement(16, ep)
    after = rebalance(load, 16 + REDUNDANT, RANKS)
    assert sorted(set(after)) == list(range(16)) and len(after) == 20
    assert after.count(0) >= 2  # the hottest expert is replicated
    for r in range(RANKS):  # no rank holds two replicas of one expert
        mine = after[r * 5 : (r + 1) * 5]
        assert len(set(mine)) == len(mine)
    b, a = imbalance(rank_loads(load, before, RANKS)), imbalance(rank_loads(load, after, RANKS))
    assert a < b and a < 1.1 < 1.5 < b


def test_rebalance_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        rebalance([1, 2, 3], 2, 1)  # fewer slots than experts
    with pytest.raises(ValueError):
        rebalance([1, 2, 3, 4], 6, 4)  # slots not a multiple of ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kvmesh.engine.tokenizer import default_gguf_path, load_gguf_tokenizer

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("qwen3_moe")
    save_tiny("qwen3_moe", path, load_gguf_tokenizer(default_gguf_path()))
    return path


def skewed_run(loaded) -> torch.Tensor:
    """Logits of a batch whose tokens repeat a few ids: routing piles onto a few experts."""
    loop = PagedLoop(loaded)
    first = loop.step([(0, [7] * 40), (1, [7, 8] * 12), (2, list(range(100, 116)))])
    rest = loop.step([(0, [7]), (1, [8]), (2, [9])])
    return torch.cat([first, rest])


def test_rebalance_lowers_imbalance_and_keeps_outputs(checkpoint) -> None:
    ep = ExpertParallelConfig(0, 1, None, num_redundant_experts=REDUNDANT)
    loaded = load_model(str(checkpoint), expert_parallel=ep)
    reference = load_model(str(checkpoint))  # no redundant slots
    want = skewed_run(reference)
    got = skewed_run(loaded)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # replicas split tokens exactly
    before = expert_load(loaded.model, num_ranks=RANKS)
    top_k = loaded.config.moe.num_experts_per_tok
    assert all(sum(c) == (40 + 24 + 16 + 3) * top_k for c in before.expert_counts)
    assert before.imbalance > 1.5
    rebalance_model(loaded.model, num_ranks=RANKS)
    assert all(sum(r) == 0 for r in expert_load(loaded.model, num_ranks=RANKS).rank_tokens)
    after_logits = skewed_run(loaded)
    torch.testing.assert_close(after_logits, want, atol=1e-5, rtol=0)
    after = expert_load(loaded.model, num_ranks=RANKS)  # measured on the same batch again
    assert after.imbalance < before.imbalance
    assert all(abs(sum(s) - 1) < 1e-9 for s in after.rank_share)
    assert after.expert_counts == [[2 * c for c in layer] for layer in before.expert_counts]


def test_apply_placement_moves_weights(checkpoint) -> None:
    ep = ExpertParallelConfig(0, 1, None, num_redundant_experts=2)
    loaded = load_model(str(checkpoint), expert_parallel=ep)
    blocks = loaded.model.moe_layers()
    old = [b.w13.detach().clone() for b in blocks]
    new = [[7, 6, 5, 4, 3, 2, 1, 0, 7, 7] for _ in blocks]
    apply_placement(loaded.model, new)
    for b, w in zip(blocks, old, strict=True):  # old slot e held expert e (e < 8)
        assert b.local_logical() == new[0]
        assert torch.equal(b.w13[0], w[7]) and torch.equal(b.w13[9], w[7])
        assert b.replica_count[7] == 3 and b.replica_count[0] == 1
    with pytest.raises(ValueError, match="every logical expert"):
        apply_placement(loaded.model, [[0] * 10 for _ in blocks])
    with pytest.raises(ValueError, match="placements for"):
        apply_placement(loaded.model, [])


def test_eplb_state_rebalances_every_interval(checkpoint) -> None:
    ep = ExpertParallelConfig(0, 1, None, num_redundant_experts=REDUNDANT)
    loaded = load_model(str(checkpoint), expert_parallel=ep)
    model, loop = loaded.model, PagedLoop(loaded)
    state = EplbState(window_size=1, step_interval=2)
    loop.step([(0, list(range(100, 120)))])
    assert state.step(model) is None
    slots = [b.local_logical() for b in model.moe_layers()]
    loop.step([(1, [7] * 30)])  # the window: only this step's load counts
    seen = state.step(model)
    assert seen is not None and all(sum(c) == 50 * 2 for c in seen.expert_counts)
    after = [b.local_logical() for b in model.moe_layers()]
    assert after != slots
    hot = [max(range(8), key=lambda e, b=b: b.logical_counts[e]) for b in model.moe_layers()]
    assert all(layer.count(e) >= 2 for layer, e in zip(after, hot, strict=True))
    with pytest.raises(ValueError):
        EplbState(window_size=0)
