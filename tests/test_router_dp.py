"""Data-parallel ranks of one server as separate scheduling endpoints: pinned by the
X-data-parallel-rank header, loaded from their own metrics series, and indexed from their own
KV-event publisher (port or path offset by the rank, as vLLM offsets it)."""

from __future__ import annotations

import asyncio
import time

import yaml

from kvmesh.protocol.kv_events import BlockStored
from kvmesh.protocol.zmq_events import KVEventsConfig, ZmqEventPublisher
from kvmesh.router.app import Router, RouterConfig, start_router
from kvmesh.router.endpoints import Endpoint, data_parallel_ranks, load_endpoints_file
from kvmesh.router.event_sources import _rank_source
from tests.test_router_proxy import Engine, exchange, post

PAGE = (
    b'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
    b'vllm:num_requests_waiting{engine="1",model_name="m"} 7\n'
    b'vllm:num_requests_running{engine="0",model_name="m"} 2\n'
    b'vllm:num_requests_running{engine="1",model_name="m"} 3\n'
)


def test_ranks_from_the_endpoints_file_offset_their_event_ports(tmp_path) -> None:
    path = tmp_path / "endpoints.yaml"
    entry = {"url": "http://h:8000", "data_parallel_size": 3, "kv_events": "tcp://h:5557"}
    path.write_text(yaml.safe_dump([entry, "http://other:8000"]))
    ranks = load_endpoints_file(path)
    assert [e.name for e in ranks] == [
        "http://h:8000#dp0",
        "http://h:8000#dp1",
        "http://h:8000#dp2",
        "http://other:8000",
    ]
    assert [e.dp_rank for e in ranks] == [0, 1, 2, None]
    assert [e.kv_events for e in ranks[:3]] == ["tcp://h:5557", "tcp://h:5558", "tcp://h:5559"]
    assert {e.url for e in ranks[:3]} == {"http://h:8000"}
    assert data_parallel_ranks(Endpoint("http://h:1"), 1)[0].dp_rank is None
    path.write_text(yaml.safe_dump([{**entry, "data_parallel_size": 0}]))
    try:
        load_endpoints_file(path)
    except ValueError as exc:
        assert "data_parallel_size" in str(exc)
    else:
        raise AssertionError("a zero data_parallel_size was accepted")


def test_discovered_event_source_of_a_rank() -> None:
    one = {"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "topic": "kv"}}
    assert _rank_source(one, 2) == {
        "endpoint": "tcp://*:5559",
        "replay_endpoint": "tcp://*:5602",
        "topic": "kv",
    }
    assert _rank_source(one, None) == one["0"] == _rank_source(one, 0)
    both = {**one, "1": {"endpoint": "ipc:///x_dp1"}}
    assert _rank_source(both, 1) == {"endpoint": "ipc:///x_dp1"}


async def test_given_event_endpoints_are_reached_at_the_engine_host() -> None:
    from kvmesh.router.event_sources import discover

    (rank1,) = [
        e
        for e in data_parallel_ranks(Endpoint("http://10.0.0.5:8000", kv_events="tcp://*:5557"), 2)
        if e.dp_rank == 1
    ]
    assert (await discover(None, rank1))[0] == "tcp://10.0.0.5:5558"
    named = Endpoint("http://10.0.0.5:8000", kv_events="tcp://10.0.0.9:5557")
    assert (await discover(None, named))[0] == "bind:tcp://10.0.0.9:5557"
    given = Endpoint("http://10.0.0.5:8000", kv_events="bind:tcp://*:6000")
    assert (await discover(None, given))[0] == "bind:tcp://*:6000"


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_ranks_are_scheduled_pinned_and_indexed_apart(tokenizer, tmp_path) -> None:
    engine = await Engine("ok").start()
    engine.page = PAGE
    events = f"ipc://{tmp_path}/kv"
    path = tmp_path / "endpoints.yaml"
    path.write_text(
        yaml.safe_dump([{"url": engine.url, "data_parallel_size": 2, "kv_events": events}])
    )
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=events)
    pubs = [ZmqEventPublisher(config, rank) for rank in (0, 1)]
    picker = tmp_path / "picker.yaml"  # turns by name, with the KV-event index subscribed
    picker.write_text(
        "plugins: [{type: precise-prefix-cache-scorer}, {type: round-robin-picker}]\n"
        "schedulingProfiles: [{name: default, plugins: [{pluginRef: round-robin-picker},"
        " {pluginRef: precise-prefix-cache-scorer}]}]\n"
    )
    cfg = RouterConfig(
        endpoints_file=str(path),
        scheduler_config=str(picker),
        scrape_interval=0.05,
        engine_model_check=False,  # the fakes serve no model
    )
    router = Router(cfg, tokenizer)
    server = await start_router(router, "127.0.0.1", 0)
    port = server.server.sockets[0].getsockname()[1]
    names = [f"{engine.url}#dp0", f"{engine.url}#dp1"]
    try:
        eps = router.pool.endpoints
        await _until(lambda: sorted(eps) == names and all(e.last_scrape for e in eps.values()))
        assert [(eps[n].waiting, eps[n].running) for n in names] == [(1.0, 2.0), (7.0, 3.0)]

        answered = []
        for i in range(4):
            raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}"}))
            head = raw.split(b"\r\n\r\n", 1)[0].decode().lower()
            answered.append(head.split("x-kvmesh-endpoint: ", 1)[1].split("\r\n", 1)[0])
        seen = [h["x-data-parallel-rank"] for _, h, _ in engine.requests]
        assert sorted(seen) == ["0", "0", "1", "1"]
        assert [a.rsplit("#dp", 1)[1] for a in answered] == seen

        await _until(lambda: len(router.events.tasks) == 2)
        stored = BlockStored([111, 222, 333], None, [], 16, None, "GPU", None)

        def indexed() -> dict:
            pubs[1].publish([stored])  # again until the subscription is live
            return router.precise_index.longest_match([111, 222, 333], names)

        await _until(lambda: indexed().get(names[1]) == 3)
        assert not indexed().get(names[0])
    finally:
        await server.cleanup()
        for pub in pubs:
            pub.close()
        engine.server.close()


async def test_ranks_are_discovered_from_the_metrics_page(tokenizer) -> None:
    for discover in (True, False):
        engine = await Engine("ok").start()
        engine.page = PAGE
        cfg = RouterConfig(
            [engine.url],
            preset="round-robin",
            kv_events=None,
            scrape_interval=0.05,
            discover_data_parallel=discover,
            engine_model_check=False,
        )
        router = Router(cfg, tokenizer)
        server = await start_router(router, "127.0.0.1", 0)
        port = server.server.sockets[0].getsockname()[1]
        eps = router.pool.endpoints
        try:
            await _until(lambda eps=eps: all(e.last_scrape for e in eps.values()))
            if discover:
                assert sorted(eps) == [f"{engine.url}#dp0", f"{engine.url}#dp1"]
                assert [eps[n].waiting for n in sorted(eps)] == [1.0, 7.0]
            else:
                assert list(eps) == [engine.url] and eps[engine.url].waiting == 8.0
            for i in range(2):
                raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}"}))
                assert raw.startswith(b"HTTP/1.1 200")
            seen = sorted(h.get("x-data-parallel-rank", "-") for _, h, _ in engine.requests)
            assert seen == (["0", "1"] if discover else ["-", "-"])
        finally:
            await server.cleanup()
            engine.server.close()


async def test_ranks_are_read_again_every_few_seconds_not_every_scrape(tokenizer, monkeypatch):
    from kvmesh.router import endpoints

    reads: list[int] = []

    def counted(text: str) -> list[int]:
        reads.append(1)
        return page_ranks(text)

    page_ranks = endpoints.page_ranks
    monkeypatch.setattr(endpoints, "page_ranks", counted)
    monkeypatch.setattr(endpoints, "RANKS_EVERY", 0.5)
    engine = await Engine("ok").start()
    engine.page = PAGE.replace(b'engine="1"', b'engine="0"')  # one rank at first
    cfg = RouterConfig(
        [engine.url], preset="round-robin", kv_events=None, scrape_interval=0.02,
        engine_model_check=False,
    )  # fmt: skip
    router = Router(cfg, tokenizer)
    server = await start_router(router, "127.0.0.1", 0)
    eps = router.pool.endpoints
    try:
        e = eps[engine.url]
        scraped = e.last_scrape
        await _until(lambda: e.last_scrape > scraped + 0.2)  # ~10 scrapes
        assert list(eps) == [engine.url] and len(reads) <= 2
        engine.page = PAGE  # the second rank's series appear: split at the next ranks read
        await _until(lambda: sorted(eps) == [f"{engine.url}#dp0", f"{engine.url}#dp1"])
    finally:
        await server.cleanup()
        engine.server.close()
