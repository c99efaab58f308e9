"""The router's callback path (a request sent on a pooled keep-alive connection to the chosen
endpoint, router.forward) behaves as its task path: a failure before the first byte goes to
another endpoint, a pooled connection the endpoint closed is replaced, a late first byte and a
stalled or broken stream are cut, a client that leaves aborts the upstream exchange."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.helpers import counter
from tests.test_router_proxy import Engine, exchange, post, routed


class Scripted(Engine):
    """Answers its inference requests in the modes given, in turn, then "ok"; "hang": never
    answers (until the router hangs up). ``answered``: (mode, connection) of each, in turn."""

    def __init__(self, *modes: str) -> None:
        super().__init__("ok")
        self.modes = list(modes)
        self.answered: list[tuple[str, asyncio.StreamWriter]] = []

    @property
    def connections(self) -> int:
        return len({id(writer) for _, writer in self.answered})

    async def _answer(self, reader, writer, body: bytes) -> bool:
        self.mode = self.modes.pop(0) if self.modes else "ok"
        self.answered.append((self.mode, writer))
        if self.mode == "hang":
            await asyncio.wait_for(reader.read(1), 30)  # returns when the router hangs up
            return False
        return await super()._answer(reader, writer, body)


def status(raw: bytes) -> int:
    return int(raw[9:12])


async def test_5xx_on_a_pooled_connection_goes_to_another_endpoint(tokenizer) -> None:
    a, b = Scripted("ok", "503"), Scripted()
    async with routed(tokenizer, [a, b]) as (router, port):
        for i in range(4):  # the first two pool a connection to each
            raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}"}))
            assert status(raw) == 200, raw
            assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["echo"]["prompt"] == f"p{i}"
        assert counter(router.metrics.requests, a.url, "http_503") == 1
        assert router.metrics.retries._value.get() == 1
        assert len(a.requests) + len(b.requests) == 5
        (_, first), (mode, second) = a.answered[:2]
        assert mode == "503" and second is first  # asked on the pooled connection
        assert all(e.in_flight == 0 for e in router.pool.endpoints.values())


async def test_pooled_connection_closed_by_the_endpoint_is_replaced(tokenizer) -> None:
    engine = Scripted("ok", "hangup")  # hangs up on the second request, without a byte
    async with routed(tokenizer, [engine]) as (router, port):
        for i in range(2):
            raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}"}))
            assert status(raw) == 200, raw
        (e,) = router.pool.endpoints.values()
        assert e.healthy and e.failures == 0 and e.in_flight == 0
        assert router.metrics.retries._value.get() == 0
        assert (len(engine.requests), engine.connections) == (3, 2)


async def test_late_first_byte_on_a_pooled_connection_goes_elsewhere(tokenizer) -> None:
    a, b = Scripted("ok", "hang"), Scripted()
    async with routed(tokenizer, [a, b], first_byte_timeout=0.3) as (router, port):
        for i in range(4):
            body = {"prompt": f"p{i}", "stream": True}  # no non-streaming patience
            raw = await exchange(port, post("/v1/completions", body))
            assert status(raw) == 200, raw
        assert counter(router.metrics.requests, a.url, "timeout") == 1
        assert len(a.requests) + len(b.requests) == 5


@pytest.mark.parametrize(("mode", "event"), [("slow", b"stalled"), ("break", b"broke")])
async def test_stream_cut_on_a_pooled_connection_ends_with_an_error_event(
    tokenizer, mode: str, event: bytes
) -> None:
    engine = Scripted("ok", mode)
    async with routed(tokenizer, [engine], stream_idle_timeout=0.3) as (router, port):
        await exchange(port, post("/v1/completions", {"prompt": "warm"}))
        raw = await exchange(port, post("/v1/completions", {"prompt": "x", "stream": True}))
        outcome = "stream_idle_timeout" if mode == "slow" else "stream_error"
        assert counter(router.metrics.requests, engine.url, outcome) == 1
        (e,) = router.pool.endpoints.values()
        assert e.in_flight == 0 and e.pending_prefill_tokens == 0
    body = raw.split(b"\r\n\r\n", 1)[1]
    assert body.startswith(b"7\r\ndata: 1\r\n") and body.endswith(b"\r\n0\r\n\r\n")
    assert b"upstream stream " + event in body


async def test_client_leaving_aborts_the_pooled_exchange(tokenizer) -> None:
    engine = Scripted("ok", "slow")
    async with routed(tokenizer, [engine]) as (router, port):
        await exchange(port, post("/v1/completions", {"prompt": "warm"}))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/v1/completions", {"prompt": "x", "stream": True}))
        assert b"data: 1" in await asyncio.wait_for(reader.readuntil(b"data: 1"), 10)
        writer.close()
        await asyncio.wait_for(engine.lost.wait(), 10)
        (e,) = router.pool.endpoints.values()
        assert e.in_flight == 0 and engine.connections == 1


async def test_pipelined_requests_on_the_callback_path_keep_their_order(tokenizer) -> None:
    engine = Scripted()
    async with routed(tokenizer, [engine]) as (_, port):
        await exchange(port, post("/v1/completions", {"prompt": "warm"}))
        raw = b"".join(post("/v1/completions", {"prompt": f"p{i}"}, close=False) for i in range(5))
        out = await exchange(port, raw + post("/v1/completions", {"prompt": "last"}))
    assert out.count(b"HTTP/1.1 200") == 6
    order = [out.index(b'"prompt": "%s"' % p) for p in (b"p0", b"p1", b"p2", b"p3", b"p4")]
    assert order == sorted(order) and out.index(b'"prompt": "last"') > order[-1]
