"""The router's timeouts mean what they say in front of an engine that sends its response head
before the prefill, as vLLM does: the first-byte timeout runs until the first token (the first
SSE data line), whatever came before it, and the stream idle timeout only after a token came.
Until the first token the client has nothing, so a failure then goes to another endpoint."""

from __future__ import annotations

import asyncio

from tests.test_router_proxy import Engine, exchange, post, routed

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
TOKEN = b'data: {"choices": [{"text": "hi"}]}\n\n'
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class EarlyHead(Engine):
    """Sends an SSE head at once, then per ``mode``: ``late`` a keep-alive comment and, after
    ``prefill`` seconds, the tokens; ``hang`` nothing more; ``drop`` closes the connection."""

    def __init__(self, mode: str, prefill: float = 0.0) -> None:
        super().__init__(mode)
        self.prefill = prefill
        self.head_sent = asyncio.Event()

    async def _answer(self, reader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(SSE_HEAD)
        await writer.drain()
        self.head_sent.set()
        if self.mode == "drop":
            writer.close()
            return False
        if self.mode == "hang":
            await reader.read(1)  # returns when the router hangs up
            return False
        writer.write(chunk(b": queued\n\n"))
        await writer.drain()
        await asyncio.sleep(self.prefill)  # the prefill: several stream idle timeouts long
        writer.write(chunk(TOKEN) + chunk(DONE) + b"0\r\n\r\n")
        await writer.drain()
        return True


def answer_of(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head[9:12]), body


async def test_a_slow_prefill_after_an_early_head_is_not_a_stalled_stream(tokenizer) -> None:
    engine = EarlyHead("late", prefill=1.0)
    async with routed(tokenizer, [engine], stream_idle_timeout=0.1, first_byte_timeout=60.0) as (
        router,
        port,
    ):
        raw = await exchange(port, post("/v1/completions", {"prompt": "p", "stream": True}))
    status, body = answer_of(raw)
    assert status == 200, raw
    assert b"stalled" not in body and TOKEN in body and DONE in body
    assert b": queued" in body  # held until the first token, then passed on unchanged
    assert raw.count(b"HTTP/1.1") == 1


async def test_no_token_within_the_first_byte_timeout_goes_to_another_endpoint(tokenizer) -> None:
    hung, good = EarlyHead("hang"), EarlyHead("late")
    async with routed(tokenizer, [hung, good], first_byte_timeout=0.3, stream_idle_timeout=0.0) as (
        router,
        port,
    ):
        for i in range(3):  # round robin: the hung engine is tried first at least once
            raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}", "stream": True}))
            status, body = answer_of(raw)
            assert status == 200 and TOKEN in body and DONE in body, raw
            assert raw.count(b"HTTP/1.1") == 1  # the hung engine's head never reached the client
        assert hung.head_sent.is_set()
        assert router.metrics.requests.counts.get((hung.url, "timeout"), 0) >= 1


async def test_a_head_then_a_close_before_the_first_token_is_retried(tokenizer) -> None:
    dropper, good = EarlyHead("drop"), EarlyHead("late")
    async with routed(tokenizer, [dropper, good]) as (router, port):
        for i in range(3):
            raw = await exchange(port, post("/v1/completions", {"prompt": f"p{i}", "stream": True}))
            status, body = answer_of(raw)
            assert status == 200 and TOKEN in body and b"broke" not in body, raw
        assert dropper.head_sent.is_set()
        assert router.metrics.requests.counts.get((dropper.url, "stream_error"), 0) >= 1
        assert router.pool.endpoints[dropper.url].healthy  # it answered: not unreachable


class Poisoned(Engine):
    """Drops the connection, unanswered, on a request whose prompt says "poison" (as an engine
    that cannot answer it would); answers the rest."""

    async def _answer(self, reader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        if b"poison" in body:
            writer.close()
            return False
        return await super()._answer(reader, writer, body)


async def test_a_request_every_engine_drops_leaves_them_all_in_rotation(tokenizer) -> None:
    """The failure is the request's, not the endpoints': it may be retried elsewhere, but it
    must not take the engines out of rotation for everyone else."""
    engines = [Poisoned(), Poisoned(), Poisoned()]
    async with routed(tokenizer, engines, max_retries=2) as (router, port):
        raw = await exchange(port, post("/v1/completions", {"prompt": "poison"}))
        assert raw.startswith(b"HTTP/1.1 503"), raw
        # tried on each (again on a fresh connection where a pooled one may have gone stale)
        assert all(1 <= len(e.requests) <= 2 for e in engines)
        assert all(e.healthy for e in router.pool.endpoints.values())
        for e in engines:
            assert router.metrics.requests.counts.get((e.url, "dropped"), 0) == 1
        raw = await exchange(port, post("/v1/completions", {"prompt": "fine"}))
        assert raw.startswith(b"HTTP/1.1 200"), raw
