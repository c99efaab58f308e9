"""The router under faults: an endpoint answering 5xx is ejected and comes back, a hung one is
left after the first-byte timeout, a stalled stream is cut with an SSE error event, a restarted
one is back within a scrape or two; and the KV-event index is whole on start (replay from 0),
after a publisher restart (its entries cleared) and after a lost batch (replayed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import zmq

from kvmesh.protocol.kv_events import BlockStored, KVEventBatch, encode_batch
from kvmesh.protocol.zmq_events import END_SEQ, KVEventsConfig, ZmqEventPublisher
from kvmesh.router.app import Router, RouterConfig, start_router
from kvmesh.router.endpoints import MAX_BACKOFF, Endpoint, EndpointPool
from kvmesh.router.events import EventIngest
from kvmesh.router.index import PreciseIndex
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.outlier import OutlierDetection
from tests.conftest import emulated_fleet
from tests.helpers import counter
from tests.test_router_proxy import Engine, exchange, post, routed


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def status(raw: bytes) -> int:
    return int(raw[9:12])


def endpoint_of(raw: bytes) -> str:
    """The endpoint the router names in its answer's x-kvmesh-endpoint header."""
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"x-kvmesh-endpoint":
            return value.strip().decode()
    raise AssertionError("no x-kvmesh-endpoint header")


@contextlib.asynccontextmanager
async def router_for(tokenizer, urls: list[str], **config):
    config = {"preset": "round-robin", "kv_events": None, **config}
    config.setdefault("engine_model_check", False)  # the fakes serve no model
    cfg = RouterConfig(urls, scrape_interval=0.05, **config)
    router = Router(cfg, tokenizer)
    server = await start_router(router, "127.0.0.1", 0)
    try:
        yield router, server.server.sockets[0].getsockname()[1]
    finally:
        await server.cleanup()


# ---- ejection and re-admission -------------------------------------------------------------


def test_ejection_is_capped_multiplied_and_spares_the_fleet() -> None:
    eps = [Endpoint(f"http://e{i}:1") for i in range(3)]
    pool = EndpointPool(eps, outlier=OutlierDetection(2, 10.0, 25.0, 50.0))
    for _ in range(2):
        for e in eps:
            pool.request_failed(e, "5xx")
    # half of three is one: the others keep serving, their count standing
    assert [e.ejected for e in eps] == [True, False, False]
    assert [e.name for e in pool.candidates()] == ["http://e1:1", "http://e2:1"]
    span = eps[0].ejected_until - time.monotonic()
    assert 9.0 < span <= 10.0
    eps[0].ejected_until = time.monotonic() - 1.0  # its time is up; it fails again at once
    pool.request_failed(eps[1], "5xx")  # now there is room: e1 goes
    assert eps[1].ejected
    for _ in range(2):
        pool.request_failed(eps[0], "5xx")
    assert not eps[0].ejected or eps[0].ejected_until <= time.monotonic()  # no room: one max
    eps[1].ejected_until = 0.0
    for _ in range(2):
        pool.request_failed(eps[0], "5xx")
    span = eps[0].ejected_until - time.monotonic()
    assert 19.0 < span <= 20.0  # second ejection: twice the base
    alone = Endpoint("http://alone:1")
    lone = EndpointPool([alone], outlier=OutlierDetection(1, 10.0, 25.0, 100.0))
    lone.request_failed(alone, "timeout")  # the last in rotation stays
    assert not alone.ejected and lone.candidates() == [alone]
    for _ in range(3):
        e = Endpoint("http://x:1")
        for _ in range(12):
            e.mark_failure(time.monotonic())
        assert e.retry_at - time.monotonic() <= MAX_BACKOFF


async def test_5xx_endpoint_is_ejected_then_readmitted_with_no_client_failure(tokenizer) -> None:
    bad, good = Engine("503"), Engine("ok")
    config = {"outlier_consecutive_errors": 3, "outlier_base_ejection_time": 1.0}
    async with routed(tokenizer, [bad, good], scrape_interval=0.05, **config) as (router, port):
        for i in range(10):
            raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}"}))
            assert status(raw) == 200, raw
        assert len(bad.requests) == 3  # ejected at its third 5xx, asked nothing since
        assert counter(router.metrics.ejections, bad.url, "5xx") == 1
        e = router.pool.endpoints[bad.url]
        scraped = e.last_scrape
        await until(lambda: e.last_scrape > scraped + 0.1)  # scrapes succeed meanwhile ...
        assert e.healthy and e not in router.pool.candidates()  # ... and do not undo it
        assert b'kvmesh_router_endpoint_ejected{endpoint="%s"} 1.0' % bad.url.encode() in (
            router.render_metrics()
        )
        bad.mode = "ok"
        await until(lambda: e in router.pool.candidates())
        await until(lambda: counter(router.metrics.readmissions, bad.url, "ejection_expired"))
        for i in range(4):
            raw = await exchange(port, post("/v1/completions", {"prompt": f"q{i}"}))
            assert status(raw) == 200, raw
        assert len(bad.requests) == 5


async def test_hung_engine_loses_its_requests_to_another_after_the_timeout(tokenizer) -> None:
    with emulated_fleet(tokenizer, 2) as (urls, fleet):
        fleet.bundles[0].faults.update({"hang_rate": 1.0})
        async with router_for(
            tokenizer, urls, first_byte_timeout=0.3, non_streaming_first_byte_timeout=0.6
        ) as (router, port):
            for i in range(4):
                body = {"prompt": f"hello {i}", "max_tokens": 3, "stream": i % 2 == 0}
                raw = await exchange(port, post("/v1/completions", body))
                assert status(raw) == 200 and urls[1].encode() in raw, raw
            assert fleet.bundles[0].faults.counts["hangs"] >= 1
            assert counter(router.metrics.requests, urls[0], "timeout") >= 1


async def test_a_slow_non_streaming_answer_gets_the_longer_timeout(tokenizer) -> None:
    with emulated_fleet(tokenizer, 1, emulate_ttft_ms=1500.0) as (urls, _):
        async with router_for(
            tokenizer, urls, first_byte_timeout=0.2, non_streaming_first_byte_timeout=60.0
        ) as (router, port):
            body = {"prompt": "slow", "max_tokens": 2}
            raw = await exchange(port, post("/v1/completions", {**body, "stream": True}))
            assert status(raw) == 503, raw  # the only endpoint, given up
            raw = await exchange(port, post("/v1/completions", body))
            assert status(raw) == 200, raw


async def test_stalled_stream_is_cut_with_an_sse_error_event(tokenizer) -> None:
    with emulated_fleet(tokenizer, 1, fault_stall_rate=1.0, fault_stall_seconds=60.0) as (
        urls,
        fleet,
    ):
        async with router_for(tokenizer, urls, stream_idle_timeout=0.3) as (router, port):
            body = {"prompt": "stall", "max_tokens": 16, "stream": True}
            raw = await exchange(port, post("/v1/completions", body))
            assert fleet.bundles[0].faults.counts["stalls"] == 1
    assert status(raw) == 200
    assert raw.count(b"data: {") >= 2 and b"upstream stream stalled" in raw
    assert raw.endswith(b"\r\n0\r\n\r\n") and b"[DONE]" not in raw
    assert counter(router.metrics.requests, urls[0], "stream_idle_timeout") == 1
    assert router.pool.endpoints[urls[0]].errors == 1


class Restartable(Engine):
    """A scripted engine that can die (its port closed, its connections cut) and come back."""

    async def start(self, port: int = 0) -> Restartable:
        self.writers: set[asyncio.StreamWriter] = set()
        self.server = await asyncio.start_server(self._tracked, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _tracked(self, reader, writer) -> None:
        self.writers.add(writer)
        try:
            await self._conn(reader, writer)
        finally:
            self.writers.discard(writer)

    async def kill(self) -> None:
        self.server.close()
        for w in list(self.writers):
            w.transport.abort()
        await self.server.wait_closed()


async def test_dead_then_restarted_endpoint_is_back_within_a_few_scrapes(tokenizer) -> None:
    engine = await Restartable().start()
    async with routed(tokenizer, [engine], scrape_interval=0.05) as (router, port):
        (e,) = router.pool.endpoints.values()
        await until(lambda: e.last_scrape > 0)
        await engine.kill()
        await until(lambda: e.failures >= 4)  # the back-off is at its cap by now
        assert e not in router.pool.candidates()
        assert counter(router.metrics.ejections, e.name, "unreachable") == 1
        await engine.start(engine.port)
        await until(lambda: e.healthy, timeout=3 * MAX_BACKOFF)
        assert counter(router.metrics.readmissions, e.name, "reachable") == 1
        raw = await exchange(port, post("/v1/completions", {"prompt": "back"}))
        assert status(raw) == 200, raw
    engine.server.close()


# ---- KV events: replay on start, publisher restart, lost batches -----------------------------


def stored(h: int) -> BlockStored:
    return BlockStored([h], None, [1, 2], 2, None, "GPU", None)


def ipc_addresses(folder) -> tuple[str, str]:
    """Publisher and replay sockets in a test's own folder: no port to race for."""
    return f"ipc://{folder}/kv", f"ipc://{folder}/replay"


def ipc_publisher(folder) -> ZmqEventPublisher:
    events, replay = ipc_addresses(folder)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=events, replay_endpoint=replay)
    return ZmqEventPublisher(config)


def held(index: PreciseIndex, hashes: list[int]) -> list[int]:
    """Of these blocks (each queried alone), the ones the index holds for endpoint e."""
    return [h for h in hashes if index.longest_match([h], ["e"]).get("e")]


@contextlib.asynccontextmanager
async def ingest_of(events: str, replay: str, check_interval: float = 2.0):
    """An EventIngest following endpoint "e" whose publisher is at these addresses."""
    index, metrics = PreciseIndex(), RouterMetrics()
    ingest = EventIngest(index, None, metrics, check_interval=check_interval)
    e = Endpoint("http://127.0.0.1:1", "e", kv_events=events)
    e.kv_events_replay = replay
    ingest.watch(e)
    try:
        yield ingest, index, metrics
    finally:
        await ingest.stop()


async def test_fresh_ingest_replays_the_history_from_zero(tmp_path) -> None:
    pub = ipc_publisher(tmp_path)
    try:
        for h in range(40):
            pub.publish([stored(h)])
        time.sleep(0.2)  # all sent (to nobody) and buffered
        async with ingest_of(*ipc_addresses(tmp_path)) as (ingest, index, metrics):
            await until(lambda: len(held(index, list(range(40)))) == 40)
            assert counter(metrics.kv_event_replays, "e", "start") == 1
            assert metrics.kv_index_warm.labels("e")._value.get() == 1
            pub.publish([stored(99)])  # live ones follow
            await until(lambda: held(index, [99]) == [99])
            assert ingest.batches == 1 and ingest.feeds["e"].last == 40
    finally:
        pub.close()


async def test_restarted_publisher_has_its_stale_entries_cleared(tmp_path) -> None:
    pub = ipc_publisher(tmp_path)
    async with ingest_of(*ipc_addresses(tmp_path), check_interval=0.2) as (ingest, index, metrics):
        try:
            for h in (1, 2, 3):
                pub.publish([stored(h)])
            await until(lambda: held(index, [1, 2, 3]) == [1, 2, 3])
        finally:
            pub.close()
        pub = ipc_publisher(tmp_path)  # the engine restarted: seq from 0 again
        try:
            pub.publish([stored(100)])
            await until(lambda: held(index, [1, 2, 3, 100]) == [100])
            assert counter(metrics.kv_event_replays, "e", "restart") == 1
            assert ingest.restarts == 1
        finally:
            pub.close()


async def test_a_new_router_knows_what_the_engines_cached_before_it_started(
    tokenizer, tmp_path
) -> None:
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/kv",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
    }
    engine = {"kv_events_config": json.dumps(events), "num_gpu_blocks": 1024}
    with emulated_fleet(tokenizer, 2, engine=engine) as (urls, _):
        async with router_for(tokenizer, urls, preset="precise-prefix", kv_events="auto") as (
            first,
            port,
        ):
            await until(lambda: all(f.warm for f in first.events.feeds.values()))
            homes = []
            for i in range(6):
                body = {"prompt": f"session {i} " + "context words " * 60, "max_tokens": 2}
                raw = await exchange(port, post("/v1/completions", body))
                assert status(raw) == 200
                homes.append(endpoint_of(raw))
            await until(lambda: first.precise_index.num_entries() > 0)
            await asyncio.sleep(0.3)  # the last events are in
            before = first.precise_index.num_entries()
        # a router started afresh (after a kill, say) reads the engines' replay buffers
        async with router_for(tokenizer, urls, preset="precise-prefix", kv_events="auto") as (
            second,
            port,
        ):
            # the first requests, sent at once, wait for the replay and follow their prefix
            bodies = [
                {"prompt": f"session {i} " + "context words " * 60 + "next", "max_tokens": 2}
                for i in range(6)
            ]
            raws = await asyncio.gather(
                *(exchange(port, post("/v1/completions", b)) for b in bodies)
            )
            assert [endpoint_of(raw) for raw in raws] == homes
            await until(lambda: second.precise_index.num_entries() >= before)
            await until(lambda: all(f.warm for f in second.events.feeds.values()))
            text = second.render_metrics().decode()
            assert text.count('kvmesh_router_kv_event_replays_total{endpoint="http') == 2
            assert 'kvmesh_router_kv_index_warm{endpoint="' in text


class LossyPublisher:
    """vLLM's publisher protocol (PUB + replay ROUTER), where a batch can get its seq and a
    place in the replay buffer yet never go out live, as on a lossy network."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.pub, self.router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.lock, self.done = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, h: int, send: bool = True) -> None:
        payload = encode_batch(KVEventBatch(ts=time.time(), events=[stored(h)]))
        with self.lock:
            seq = len(self.buffer)
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:  # only this thread touches the ROUTER socket
        while not self.done.is_set():
            if not self.router.poll(20):
                continue
            ident, _, start = self.router.recv_multipart()
            with self.lock:
                batches = [b for b in self.buffer if b[0] >= int.from_bytes(start, "big")]
            for seq, payload in batches:
                self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def test_lost_batches_are_replayed_mid_stream_and_before_a_quiet_spell() -> None:
    pub = LossyPublisher()
    try:
        async with ingest_of(
            f"tcp://*:{pub.port}", f"tcp://*:{pub.replay}", check_interval=0.3
        ) as (ingest, index, m):
            await until(lambda: ingest.feeds["e"].warm)
            pub.publish(0)
            await until(lambda: held(index, [0]) == [0])  # the subscription is live
            pub.publish(1, send=False)
            pub.publish(2)  # shows the gap
            await until(lambda: held(index, [0, 1, 2]) == [0, 1, 2])
            assert counter(m.kv_event_replays, "e", "gap") == 1
            pub.publish(3, send=False)  # the last before a quiet spell
            await until(lambda: held(index, [3]) == [3])
            assert counter(m.kv_event_replays, "e", "gap") == 2
            assert ingest.feeds["e"].last == 3 and ingest.restarts == 0
    finally:
        pub.close()
