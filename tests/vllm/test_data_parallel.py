"""kvmesh's router in front of one vLLM CPU server with two data-parallel ranks (internal load
balancing): it finds the ranks on the server's /metrics (engine="0", engine="1"), indexes each
from its own KV-event publisher (ports offset by the rank), and pins a request to the rank
that holds its prefix with the X-data-parallel-rank header."""

from __future__ import annotations

import pytest

from kvmesh.protocol.kv_events import BlockStored
from tests.vllm.events import EventRecorder
from tests.vllm.fleet import Engine, Fleet, cached_tokens, routed_fleet, text_prompt
from tests.vllm.procs import offset_port, start_router, start_vllm

pytestmark = pytest.mark.vllm

RANKS = 2


@pytest.fixture(scope="module")
def dp_fleet(vllm_python, model_dir, log_dir, router_tokenizer):
    started, recorders = [], []
    try:
        proc, events = start_vllm(
            vllm_python,
            model_dir,
            log_dir,
            "vllm-dp",
            num_blocks=64,
            extra=["--data-parallel-size", str(RANKS)],
            event_ranks=RANKS,
        )
        started.append(proc)
        try:
            proc.wait_healthy()
        except (RuntimeError, TimeoutError) as exc:
            pytest.skip(f"vLLM CPU did not start with --data-parallel-size {RANKS}: {exc}")
        engines = []
        for rank in range(RANKS):
            recorders.append(EventRecorder(offset_port(events["endpoint"], rank), events["topic"]))
            headers = {"X-data-parallel-rank": str(rank)}
            engines.append(Engine(f"{proc.url}#dp{rank}", proc.url, recorders[-1], headers))
        router = start_router([proc.url], model_dir, log_dir)
        started.append(router)
        yield routed_fleet(router, engines, router_tokenizer.block_keys)
    finally:
        for rec in recorders:
            rec.close()
        for p in reversed(started):
            p.stop()


def test_each_rank_is_an_endpoint_indexed_from_its_own_events(dp_fleet: Fleet) -> None:
    dp_fleet.reset_caches()
    for rank in range(RANKS):
        value = dp_fleet.router_value(
            "kvmesh_router_endpoint_healthy", endpoint=dp_fleet.engines[rank].name
        )
        assert value == 1, f"rank {rank} is not a healthy endpoint of the router"
    holders = {"dp-first": dp_fleet.engines[1], "dp-second": dp_fleet.engines[0]}
    for tag, engine in holders.items():  # pinned past the router: only KV events tell it
        mark = engine.events.mark()
        dp_fleet.direct(engine, text_prompt(tag, 90))
        engine.events.wait_for(
            lambda e=engine, m=mark: bool(e.events.events(m, BlockStored)), f"{tag}'s blocks"
        )
        ranks = {b.data_parallel_rank for _, b in engine.events.batches[mark:]}
        assert ranks == {dp_fleet.engines.index(engine)}
    dp_fleet.wait_index_in_sync()
    for tag, engine in holders.items():
        chosen, out, predicted = dp_fleet.routed(
            "/v1/completions", {"prompt": text_prompt(tag, 90) + " and more"}
        )
        assert chosen == engine.name, tag
        assert cached_tokens(out) > 0 and predicted == cached_tokens(out)
