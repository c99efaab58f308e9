"""One request's fan-out (its prompts times n) is capped, before any prompt is tokenized, by the
engine and by the router in front of it (--max-choices-per-request: 400); what the cap admits
enters the engine's waiting queue whole or not at all (503, nothing queued), and the
vllm:num_requests_waiting gauge counts what waits from the moment it is admitted."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig, build_emulated_engine
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.protocol.openai import APIError
from kvmesh.protocol.prompt import CompletionFields, check_choices
from tests.test_input_limits import CHAT, HELLO, post, stack

LABELS = {"model_name": "Llama-3.1-8B", "engine": "0"}


@pytest.fixture(scope="module")
def fleet(tokenizer):
    with stack(tokenizer, trust=False) as s:
        yield s


def _fan_out_refused(code: int, out: dict, asked: int) -> bool:
    message = out["error"]["message"]
    return code == 400 and f"asks for {asked} choices" in message and "at most 256" in message


def test_a_fan_out_past_the_cap_is_refused_before_anything_is_tokenized(fleet, monkeypatch):
    from kvmesh.engine import serving

    router_url, engine_url, router = fleet
    calls: list[str] = []
    monkeypatch.setattr(serving, "encode", lambda *a: calls.append("engine") or [1])
    real = router.tokens.ids_and_keys
    monkeypatch.setattr(
        router.tokens, "ids_and_keys", lambda *a: calls.append("router") or real(*a)
    )
    many = {"prompt": [f"prompt {i}" for i in range(257)], "max_tokens": 1}
    for url in (router_url, engine_url):
        code, out = post(url, "/v1/completions", many)
        assert _fan_out_refused(code, out, 257)
    assert calls == []
    # prompts times n, and a chat's n: the router refuses them before the engine sees them
    code, out = post(router_url, "/v1/completions", {"prompt": ["a", "b"], "n": 200})
    assert _fan_out_refused(code, out, 400) and "2 prompts times n=200" in out["error"]["message"]
    code, out = post(router_url, CHAT, {"messages": HELLO, "n": 300})
    assert _fan_out_refused(code, out, 300)
    assert calls == []
    ok = {"prompt": [f"prompt {i}" for i in range(256)], "max_tokens": 1}
    assert [post(u, "/v1/completions", ok)[0] for u in (router_url, engine_url)] == [200, 200]


def test_the_fan_out_counts_prompts_as_the_engine_does():
    def asked(prompt, n: int = 1) -> None:
        check_choices(CompletionFields(prompt=prompt, n=n), 2)

    for fits in ("text", [1, 2, 3], ["a", "b"], [[1], [2]], [], ["a"]):
        asked(fits)
    asked("text", 2)
    for past in (["a", "b", "c"], [[1], [2], [3]]):
        with pytest.raises(APIError, match="3 choices"):
            asked(past)
    with pytest.raises(APIError, match="4 choices"):
        asked(["a", "b"], 2)


def _engine(tokenizer, max_waiting: int):
    config = EngineConfig(max_model_len=4096, max_waiting_requests=max_waiting)
    emu = EmulationConfig(emulate_ttft_ms=1.0, emulate_itl_ms=0.1)
    return build_emulated_engine(config, emu, tokenizer)


def _requests(*ids: str) -> list[Request]:
    return [Request(rid, [1, 2, 3], SamplingParams(max_tokens=2)) for rid in ids]


async def _finish(streams) -> None:
    for stream in streams:
        async for out in stream:
            if out.finished:
                break


async def test_a_request_the_waiting_queue_cannot_take_whole_queues_nothing(tokenizer):
    bundle = _engine(tokenizer, max_waiting=4)
    engine, registry = bundle.engine, bundle.metrics.registry
    engine.start()
    try:
        first = engine.generate_all(_requests("a", "b", "c"))  # admitted, not yet stepped

        def gauge() -> float | None:
            return registry.get_sample_value("vllm:num_requests_waiting", LABELS)

        assert engine.num_waiting == 3 and gauge() == 3  # counted before any step
        with pytest.raises(APIError) as refused:
            async for _ in bundle.serving.run(_requests("d", "e")):
                pass
        assert refused.value.status == 503
        assert "3 requests are waiting; this request's 2 would not fit" in refused.value.message
        assert engine.num_waiting == 3 and gauge() == 3
        assert not engine.in_flight("d") and not engine.in_flight("e")
        await _finish(first)
        fits = [out async for _, out in bundle.serving.run(_requests("f"))]
        assert fits[-1].finished and fits[-1].finish_reason == "length"
        done = {
            reason: registry.get_sample_value(
                "vllm:request_success_total", {**LABELS, "finished_reason": reason}
            )
            for reason in ("length", "abort")
        }
        assert done == {"length": 4, "abort": None}  # d and e never queued, so never aborted
        assert gauge() == 0 and engine.num_waiting == 0
    finally:
        engine.shutdown()


async def test_streams_never_read_are_aborted_when_the_request_ends(tokenizer):
    bundle = _engine(tokenizer, max_waiting=8)
    engine = bundle.engine
    engine.start()
    try:
        run = bundle.serving.run(_requests("x", "y", "z"))
        await anext(run)  # the first output of one of them; the others unread
        await run.aclose()  # the client left
        assert [engine.in_flight(r) for r in ("x", "y", "z")] == [False, False, False]
        await asyncio.wait_for(_until_idle(engine), 30)
        assert engine.core.scheduler.num_running == 0 and engine.num_waiting == 0
    finally:
        engine.shutdown()


async def _until_idle(engine) -> None:
    """Until the engine has applied what it was sent (a call runs between steps)."""
    while await engine.call(lambda core: core.has_work()):
        pass
