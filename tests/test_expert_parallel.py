"""Expert parallelism on gloo with 2 processes against the single-process model.

Each rank loads only its expert slots and runs its own batch: different token counts per rank,
one rank idle (run_idle_step) while the other decodes, then an EPLB rebalance that moves expert
weights between the ranks mid-run. Every rank's logits must equal the single-process model's
for the same sequences. A failure never hangs: the gloo timeout is short and the parent kills
workers that outlive their deadline.
"""

from __future__ import annotations

import datetime
import multiprocessing
import traceback

import pytest
import torch

from kvmesh.engine.models.expert_parallel import ExpertParallelConfig, initial_placement
from kvmesh.engine.models.loader import load_model
from kvmesh.engine.models.moe import SparseMoeBlock
from tests.test_model_hf import PagedLoop
from tests.test_moe_model import save_tiny

DEADLINE_S = 120
Step = list[tuple[int, list[int]]] | None  # (sequence, new tokens) chunks; None: idle rank


def scenario(rank: int) -> list[Step]:
    """Fixed token ids (no sampling), so the reference replays the same inputs."""
    p = [[11, 42, 7, 99, 3, 250, 17], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [300, 301, 302]]
    if rank == 0:
        return [[(0, p[0])], [(0, [41])], [(0, [42]), (1, p[2])], [(0, [43]), (1, [44])]]
    return [[(5, p[1]), (6, p[2][:2])], None, [(5, [61])], [(5, [62]), (6, [63])]]


REBALANCE_BEFORE = 3  # step index: every rank rebalances (collectively) before it


CASES = [("linear", 0), ("round_robin", 2)]  # (--expert-placement-strategy, redundant slots)


def worker(rank: int, path: str, store_path: str, out: str) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, 2)
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        results = [run_case(rank, path, placement, r) for placement, r in CASES]
        torch.save(results, out)
        dist.destroy_process_group()
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def run_case(rank: int, path: str, placement: str, redundant: int) -> dict:
    import torch.distributed as dist

    from kvmesh.engine.models.eplb import expert_load, rebalance_model

    ep = ExpertParallelConfig(rank, 2, dist.group.WORLD, placement, redundant)
    loaded = load_model(path, expert_parallel=ep)
    model = loaded.model
    blocks = model.moe_layers()
    held = {"slots": blocks[0].local_logical(), "w13": blocks[0].w13.detach().clone()}
    loop, logits = PagedLoop(loaded), []
    for i, step in enumerate(scenario(rank)):
        if i == REBALANCE_BEFORE:
            rebalance_model(model)
            held["after"] = blocks[0].local_logical()
        if step is None:
            model.run_idle_step()
            logits.append(None)
        else:
            logits.append(loop.step(step))
    load = expert_load(model, gather=True)
    return {"logits": logits, "held": held, "load": load._asdict()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kvmesh.engine.tokenizer import default_gguf_path, load_gguf_tokenizer

    path = tmp_path_factory.mktemp("qwen3_moe")
    save_tiny("qwen3_moe", path, load_gguf_tokenizer(default_gguf_path()))
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Single-process logits for each rank's scenario, and the full model's experts."""
    torch.set_num_threads(1)
    loaded = load_model(str(checkpoint))
    refs = {}
    for rank in (0, 1):
        loop = PagedLoop(loaded)
        refs[rank] = [None if s is None else loop.step(s) for s in scenario(rank)]
    return loaded, refs


@pytest.fixture(scope="module")
def ep2_results(checkpoint, tmp_path_factory) -> list[list[dict]]:
    """[rank][case] results of one 2-process gloo run through every case in CASES."""
    tmp = tmp_path_factory.mktemp("ep2")
    ctx = multiprocessing.get_context("spawn")
    store, outs = str(tmp / "store"), [tmp / f"rank{r}.pt" for r in (0, 1)]
    procs = [
        ctx.Process(target=worker, args=(r, str(checkpoint), store, str(outs[r])), daemon=True)
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(DEADLINE_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    results = [torch.load(o, weights_only=False) for o in outs if o.exists()]
    errors = [r["error"] for r in results if isinstance(r, dict)]
    assert not hung and not errors and len(results) == 2, (hung, errors)
    return results


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{p}-R{r}" for p, r in CASES])
def test_ep2_equals_single_process(reference, ep2_results, case: int) -> None:
    loaded, refs = reference
    placement, redundant = CASES[case]
    results = [ep2_results[rank][case] for rank in (0, 1)]
    num_experts = loaded.config.moe.num_experts
    ep = ExpertParallelConfig(0, 2, object(), placement, redundant)  # type: ignore[arg-type]
    layout = initial_placement(num_experts, ep)
    full = loaded.model.moe_layers()[0]
    for rank, res in enumerate(results):
        per_rank = len(layout) // 2
        slots = layout[rank * per_rank : (rank + 1) * per_rank]
        assert res["held"]["slots"] == slots  # only this rank's experts were loaded
        assert torch.equal(res["held"]["w13"], full.w13.detach()[slots])
        for got, want in zip(res["logits"], refs[rank], strict=True):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # both ranks see the same group-wide load; every routed pair was counted once
    assert results[0]["load"] == results[1]["load"]
    pairs = sum(len(t) for r in (0, 1) for s in scenario(r) if s for _, t in s)
    top_k = loaded.config.moe.num_experts_per_tok
    assert all(sum(c) == pairs * top_k for c in results[0]["load"]["expert_counts"])
    after = [res["held"]["after"] for res in results]
    assert sorted(set(after[0] + after[1])) == list(range(num_experts))  # still every expert
    assert set(after[0]) != set(results[0]["held"]["slots"])  # experts moved between ranks


def test_ep_config_validation() -> None:
    with pytest.raises(ValueError, match="process group"):
        ExpertParallelConfig(0, 2, None)
    with pytest.raises(ValueError, match="placement"):
        ExpertParallelConfig(0, 1, None, placement="random")
    with pytest.raises(ValueError, match="outside"):
        ExpertParallelConfig(2, 2, None)
    with pytest.raises(ValueError, match="multiple"):
        initial_placement(8, ExpertParallelConfig(0, 3, object()))  # type: ignore[arg-type]
    rr = ExpertParallelConfig(0, 2, object(), "round_robin")  # type: ignore[arg-type]
    assert initial_placement(8, rr) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert initial_placement(6, ExpertParallelConfig(0, 2, object(), num_redundant_experts=2)) == [
        0,
        1,
        2,
        3,
        4,
        5,
        0,
        1,
    ]


def test_zero_tokens_single_process(reference) -> None:
    loaded, _ = reference
    block = loaded.model.moe_layers()[0]
    assert isinstance(block, SparseMoeBlock)
    out = block(torch.zeros(0, loaded.config.hidden_size))
    assert out.shape == (0, loaded.config.hidden_size)
    loaded.model.run_idle_step()  # no group: a no-op that must not fail
