"""One emulated DP/EP instance in one process: the front door serves and streams, routes by
X-data-parallel-rank and balances, merges every rank's /metrics and /kv_event_sources, each rank
publishes its own KV events, the router finds the ranks; with --enable-expert-parallel the
ranks step on one group clock (priced by the wide-EP roofline), without it each on its own."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig
from kvmesh.engine.emulation.dp_server import EmulatedDataParallel
from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS, SequenceWork
from kvmesh.engine.emulation.wide_ep import WideEPRoofline
from kvmesh.protocol.zmq_events import KVEventSubscriber
from tests.helpers import bound_port, http, loop_thread

N = 4
FAST = {"emulate_model": "glm-5.2-moe", "emulate_ttft_ms": 20.0, "emulate_itl_ms": 4.0}


def serve(tokenizer, engine: dict, emu: dict):
    async def start():
        server = EmulatedDataParallel(EngineConfig(**engine), EmulationConfig(**emu), tokenizer)
        await server.start("127.0.0.1", 0)
        return server

    async def stop(server) -> None:
        await server.stop()

    return loop_thread(start, stop)


@pytest.fixture(scope="module")
def events_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("emu-dp-events")


@pytest.fixture(scope="module")
def ep(tokenizer, events_dir):
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{events_dir}/kv"}
    engine = dict(
        data_parallel_size=N, enable_expert_parallel=True, kv_events_config=json.dumps(events)
    )
    with serve(tokenizer, engine, FAST) as (server, loop):
        server.loop = loop  # the test of lockstep under a lagging loop blocks it
        yield server


@pytest.fixture(scope="module")
def dp(tokenizer):
    with serve(tokenizer, {"data_parallel_size": N}, FAST) as (server, _):
        yield server


def complete(url: str, prompt: str, rank: int | None = None, max_tokens: int = 8):
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    code, head, raw = http(url + "/v1/completions", body, headers)
    return code, {k.lower(): v for k, v in head.items()}, json.loads(raw)


def metric(url: str, name: str, rank: int) -> float:
    _, _, raw = http(url + "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in raw.decode().splitlines()
        if line.startswith(name + "{") and f'engine="{rank}"' in line
    )


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        time.sleep(0.05)


def test_completions_and_streams_through_the_front_door(ep) -> None:
    code, head, body = complete(ep.url, "Hello there, ranks.", rank=2)
    assert code == 200 and head["x-data-parallel-rank"] == "2"
    assert body["usage"]["completion_tokens"] == 8
    req = urllib.request.Request(
        ep.url + "/v1/completions",
        json.dumps({"prompt": "stream me", "max_tokens": 6, "stream": True}).encode(),
        {"Content-Type": "application/json", "X-data-parallel-rank": "3"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["X-data-parallel-rank"] == "3"
        lines = [r[6:].strip().decode() for r in resp if r.startswith(b"data: ")]
    assert lines[-1] == "[DONE]" and len(lines) == 7
    assert "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
    assert http(ep.url + "/health")[0] == 200


def test_header_routing_and_balancer(dp) -> None:
    before = [metric(dp.url, "vllm:request_success_total", r) for r in range(N)]
    with ThreadPoolExecutor(2 * N) as pool:  # concurrent: the least loaded rank takes each
        answers = list(pool.map(lambda i: complete(dp.url, f"spread {i}"), range(2 * N)))
    assert all(code == 200 for code, _, _ in answers)
    assert {h["x-data-parallel-rank"] for _, h, _ in answers} == {str(r) for r in range(N)}
    for _ in range(3):
        assert complete(dp.url, "pinned", rank=1)[1]["x-data-parallel-rank"] == "1"
    after = [metric(dp.url, "vllm:request_success_total", r) for r in range(N)]
    assert sum(a - b for a, b in zip(after, before, strict=True)) == 2 * N + 3
    code, _, body = complete(dp.url, "bad", rank=N)
    assert code == 400 and "X-data-parallel-rank" in body["error"]["message"]


def test_metrics_and_event_sources_of_every_rank(ep, events_dir) -> None:
    page = http(ep.url + "/metrics")[2].decode()
    for rank in range(N):
        assert f'vllm:num_requests_running{{engine="{rank}"' in page
    assert page.count("# TYPE vllm:num_requests_running ") == 1
    sources = json.loads(http(ep.url + "/kv_event_sources")[2])
    base = f"ipc://{events_dir}/kv"
    assert {k: v["endpoint"] for k, v in sources.items()} == {
        str(r): base if r == 0 else f"{base}_dp{r}" for r in range(N)
    }
    subs = {r: KVEventSubscriber(sources[str(r)]["endpoint"]) for r in (0, 2)}
    try:
        time.sleep(0.3)  # SUB joins before the events go out
        seen: set[int] = set()
        for rank, sub in subs.items():
            complete(ep.url, f"events for rank {rank} " * 6, rank=rank)
            while (got := sub.recv(timeout=5)) is not None:
                seen.add(got[1].data_parallel_rank)
                if got[1].data_parallel_rank == rank:
                    break
        assert seen == {0, 2}
    finally:
        for sub in subs.values():
            sub.close()


def test_router_finds_every_rank(ep, tokenizer) -> None:
    from kvmesh.router.app import Router, RouterConfig, start_router

    async def start():
        router = Router(RouterConfig(endpoints=[ep.url], scrape_interval=0.05), tokenizer)
        return router, await start_router(router, "127.0.0.1", 0)

    async def stop(state) -> None:
        await state[1].cleanup()

    with loop_thread(start, stop) as ((router, server), _):
        names = [f"{ep.url}#dp{r}" for r in range(N)]
        wait_for(lambda: sorted(router.pool.endpoints) == names, what="ranks found")
        wait_for(lambda: len(router.events.tasks) == N, what="every event source subscribed")
        url = f"http://127.0.0.1:{bound_port(server)}"
        for i in range(4):
            code, head, body = complete(url, f"through the router {i}")
            assert code == 200, body
            assert head["x-data-parallel-rank"] == head["x-kvmesh-endpoint"].rsplit("#dp", 1)[1]


def test_expert_parallel_ranks_share_one_group_clock(ep) -> None:
    clock = ep.clock
    first = clock.num_steps
    before = {r: (metric(ep.url, "kvmesh:dp_lockstep_steps_total", r),
                  metric(ep.url, "kvmesh:dp_idle_steps_total", r)) for r in range(N)}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(complete, ep.url, "lockstep", r) for r in (0, 1)]
        for _ in range(4):  # the event loop lags now and then: no rank may miss a step for it
            time.sleep(0.01)
            ep.loop.call_soon_threadsafe(time.sleep, 0.02)
        answers = [f.result() for f in futures]
    assert all(code == 200 for code, _, _ in answers)
    steps = [s for s in clock.history if s.index > first]
    taken = clock.num_steps - first
    assert len(steps) == taken and taken >= 8
    for rank in (0, 1):  # one group step per token (the prefill, then 7 decodes), back to back
        mine = [s.index for s in steps if rank in s.ranks]
        assert mine == list(range(mine[0], mine[0] + 8))
    # a step lasts what the slowest rank's batch costs (constant mode: 20 ms with a prefill in
    # it, else 4 ms), for every rank that took part: the one the group clock recorded
    assert all(s.time == (0.02 if s.cost.compute == 0.02 else 0.004) for s in steps)
    assert {s.ranks for s in steps} <= {(0,), (1,), (0, 1)}
    for rank in range(N):  # every rank stepped each time; idle ones ran the dummy step
        steps_now = metric(ep.url, "kvmesh:dp_lockstep_steps_total", rank)
        idle_now = metric(ep.url, "kvmesh:dp_idle_steps_total", rank)
        assert steps_now - before[rank][0] == taken
        busy = sum(rank in s.ranks for s in steps)
        assert idle_now - before[rank][1] == taken - busy


def test_without_expert_parallel_ranks_step_alone(dp) -> None:
    cores = [b.engine.core for b in dp.bundles]
    assert all(c.runner.lockstep_clock is None for c in cores) and dp.clock is None
    steps = [c.num_steps for c in cores]
    assert complete(dp.url, "only rank 0", rank=0)[0] == 200
    assert cores[0].num_steps - steps[0] == 8
    assert [c.num_steps for c in cores[1:]] == steps[1:]
    assert "kvmesh:dp_lockstep_steps" not in http(dp.url + "/metrics")[2].decode()


def test_wide_ep_roofline_prices_the_group_step(tokenizer) -> None:
    emu = {"emulate_model": "glm-5.2-moe", "emulate_gpu": "h200"}
    engine = {"data_parallel_size": 8, "enable_expert_parallel": True}
    reference = WideEPRoofline(ACCELERATORS["h200"], MODELS["glm-5.2-moe"], 8)
    with serve(tokenizer, engine, emu) as (server, _):
        per_block = MODELS["glm-5.2-moe"].kv_bytes_per_token * 16
        assert server.num_blocks == int(reference.kv_capacity_bytes() // per_block)
        code, _, body = complete(server.url, "priced by the roofline", rank=5, max_tokens=3)
        assert code == 200
        prompt = body["usage"]["prompt_tokens"]
        prefill, decode = list(server.clock.history)[:2]
    works = [[] for _ in range(8)]
    works[5] = [SequenceWork(prompt, 0, True)]
    assert prefill.ranks == (5,) and prefill.cost == reference.step_cost(works)
    assert prefill.cost.idle_ranks == 7 and prefill.cost.comm > 0
    works[5] = [SequenceWork(1, prompt, False)]
    assert decode.time == reference.step_cost(works).time


def test_cli_serves_an_emulated_dp_ep_instance() -> None:
    cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--port", "0", "--emulate-model",
           "glm-5.2-moe", "--emulate-gpu", "h200", "--data-parallel-size", "8",
           "--enable-expert-parallel"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "kvmesh engine ready:" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(60) and any("ready" in x for x in lines), "".join(lines)
        url = next(x for x in lines if "ready:" in x).split("ready: ", 1)[1].split("/v1")[0]
        assert "DP8/EP8 in lockstep" in "".join(lines)
        assert complete(url, "hello", rank=7, max_tokens=2)[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert proc.returncode == 0  # SIGTERM stops it cleanly
    dense = subprocess.run(
        [*cmd[:-3], "--emulate-model", "llama-3.1-8b", "--data-parallel-size", "2",
         "--enable-expert-parallel"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert dense.returncode == 2 and "needs an MoE model" in dense.stderr


def test_a_crashed_lockstep_rank_stops_the_server(tokenizer) -> None:
    engine = {"data_parallel_size": 2, "enable_expert_parallel": True}
    with serve(tokenizer, engine, {**FAST, "fault_crash_after": 1}) as (server, loop):
        assert complete(server.url, "one", rank=1)[0] == 200
        code, _, body = complete(server.url, "two", rank=1)  # the rank crashes on this one
        assert code == 503, body
        assert server.door.ranks[1].alive is False
        code, _, body = json_get(server.url + "/health")
        assert code == 503 and "rank 1: crashed" in body["error"]["message"]
        assert complete(server.url, "three", rank=1)[0] == 503
        wait_for(lambda: server.done.done(), timeout=5, what="the server stopping")
        assert server.done.result() == 1


def json_get(url: str):
    code, head, raw = http(url)
    return code, head, json.loads(raw)
