"""`kvmesh serve --data-parallel-size 2` as real processes: the front door serves and streams,
balances on running + waiting and honours X-data-parallel-rank, merges every rank's /metrics and
/kv_event_sources, gives the single-process greedy tokens, works behind the router; with
--enable-expert-parallel the ranks step in lockstep; a killed rank fails loudly, never hangs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from kvmesh.protocol.zmq_events import KVEventSubscriber
from tests.helpers import http

PROMPTS = ["The capital of France is", "1, 2, 3,", "Paged attention keeps", "Once upon a"]
READY = re.compile(r"kvmesh (?:engine|data-parallel rank \d) ready: (http://\S+)/v1")


def save_tiny(arch: str, path) -> str:
    """A tiny random HF checkpoint with SmolLM2's tokenizer: a Llama, or a Qwen3-MoE whose
    weights are spread wide (std 0.2) so greedy tokens are far from ties."""
    import torch
    import transformers

    from kvmesh.engine.tokenizer import default_gguf_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_gguf_path())
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(intermediate_size=128, **common)
        )
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, **common,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2, generator=gen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen3-moe"))


class Server:
    """`kvmesh serve` in a child process: its URL once ready; stopped (and reaped) on close."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--port", "0", *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                match = READY.search(line)
                if match and not found.is_set():
                    self.url = match.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(180) or not self.url:
            self.close()
            raise AssertionError("server did not start:\n" + "".join(self.lines[-40:]))
        self.ranks = sorted(psutil.Process(self.proc.pid).children(), key=lambda p: p.pid)
        self.ranks = [p for p in self.ranks if "spawn_main" in " ".join(p.cmdline())]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def complete(url: str, prompt: str, rank: int | None = None, **extra) -> tuple[int, dict, dict]:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    code, head, raw = http(url + "/v1/completions", body, headers)
    return code, {k.lower(): v for k, v in head.items()}, json.loads(raw)


def stream_lines(url: str, prompt: str, rank: int | None = None, **extra):
    """The SSE data lines of a streamed completion, as they arrive."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True, **extra}
    headers = {"Content-Type": "application/json"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            if raw.startswith(b"data: "):
                yield raw[6:].strip().decode()


def metric(url: str, name: str, rank: int, **labels: str) -> float:
    """The sum of a metric's series of one rank with these labels (0 when it has none yet)."""
    _, _, raw = http(url + "/metrics")
    want = [f'{k}="{v}"' for k, v in {"engine": rank, **labels}.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in raw.decode().splitlines()
        if line.startswith(name + "{") and all(w in line for w in want)
    )


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def events_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dp-events")


@pytest.fixture(scope="module")
def dp2(tiny_model, events_dir):
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{events_dir}/kv"}
    server = Server(
        "--model", tiny_model, "--data-parallel-size", "2", "--num-gpu-blocks", "64",
        "--kv-events-config", json.dumps(events),
    )  # fmt: skip
    yield server
    server.close()


def test_front_door_serves_completions_and_streams(dp2) -> None:
    code, head, body = complete(dp2.url, PROMPTS[0])
    assert code == 200 and body["usage"]["completion_tokens"] == 8, body
    assert head["x-data-parallel-rank"] in ("0", "1")
    lines = list(stream_lines(dp2.url, PROMPTS[1], rank=1))
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks)
    code, _, models = http(dp2.url + "/v1/models")
    assert code == 200 and json.loads(models)["data"][0]["id"]


def one_engine_texts(model: str, prompts: list[str]) -> list[str]:
    """Greedy completions of one in-process engine (the single-process reference)."""
    from kvmesh.engine.models.loader import load_model
    from tests.conftest import engine_server

    texts = []
    with engine_server(load_model(model), num_gpu_blocks=64, max_model_len=512) as (url, _):
        for prompt in prompts:
            code, _, body = complete(url, prompt, max_tokens=12)
            assert code == 200, body
            texts.append(body["choices"][0]["text"])
    return texts


def concurrent_texts(url: str, prompts: list[str], ranks: list) -> list[tuple[str, str]]:
    """(text, rank that answered) of prompts sent at once, each to its rank (None: any)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(
            pool.map(
                lambda pr: complete(url, pr[0], pr[1], max_tokens=12),
                zip(prompts, ranks, strict=True),
            )
        )
    assert all(code == 200 for code, _, _ in answers), answers
    return [(b["choices"][0]["text"], h["x-data-parallel-rank"]) for _, h, b in answers]


def test_greedy_outputs_equal_one_engine(dp2, tiny_model) -> None:
    answers = concurrent_texts(dp2.url, PROMPTS, [None] * len(PROMPTS))
    assert {rank for _, rank in answers} == {"0", "1"}  # both ranks served some
    assert [text for text, _ in answers] == one_engine_texts(tiny_model, PROMPTS)


def test_balancer_spreads_load_and_honours_the_header(dp2) -> None:
    before = [metric(dp2.url, "vllm:request_success_total", r) for r in (0, 1)]
    with ThreadPoolExecutor(4) as pool:  # four long requests at once: two per rank
        answers = list(pool.map(lambda i: complete(dp2.url, f"x{i}", max_tokens=200), range(4)))
    ranks = sorted(head["x-data-parallel-rank"] for _, head, _ in answers)
    assert ranks == ["0", "0", "1", "1"]
    for _ in range(3):
        code, head, _ = complete(dp2.url, "pinned", rank=1)
        assert code == 200 and head["x-data-parallel-rank"] == "1"
    after = [metric(dp2.url, "vllm:request_success_total", r) for r in (0, 1)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 5]
    code, _, body = complete(dp2.url, "bad", rank=7)
    assert code == 400 and "X-data-parallel-rank" in body["error"]["message"]


def test_metrics_and_event_sources_of_every_rank(dp2, events_dir) -> None:
    _, _, raw = http(dp2.url + "/metrics")
    page = raw.decode()
    for rank in (0, 1):
        assert f'vllm:num_requests_running{{engine="{rank}"' in page
    assert page.count("# TYPE vllm:num_requests_running ") == 1
    _, _, raw = http(dp2.url + "/kv_event_sources")
    sources = json.loads(raw)
    endpoint = f"ipc://{events_dir}/kv"
    assert {k: v["endpoint"] for k, v in sources.items()} == {
        "0": endpoint,
        "1": endpoint + "_dp1",
    }
    subs = {rank: KVEventSubscriber(sources[str(rank)]["endpoint"]) for rank in (0, 1)}
    try:
        time.sleep(0.3)  # SUB joins before the events go out
        seen: set[int] = set()
        for rank, sub in subs.items():
            complete(dp2.url, f"events for rank {rank} " * 6, rank=rank)
            while (got := sub.recv(timeout=5)) is not None:
                seen.add(got[1].data_parallel_rank)
                if got[1].data_parallel_rank == rank:
                    break
        assert seen == {0, 1}
    finally:
        for sub in subs.values():
            sub.close()


def test_router_finds_both_ranks(dp2, tokenizer) -> None:
    from kvmesh.router.app import Router, RouterConfig, start_router
    from tests.helpers import bound_port, loop_thread

    async def start():
        config = RouterConfig(endpoints=[dp2.url], scrape_interval=0.05)
        router = Router(config, tokenizer)
        return router, await start_router(router, "127.0.0.1", 0)

    async def stop(state) -> None:
        await state[1].cleanup()

    with loop_thread(start, stop) as ((router, server), _):
        names = [f"{dp2.url}#dp0", f"{dp2.url}#dp1"]
        wait_for(lambda: sorted(router.pool.endpoints) == names, what="ranks found")
        wait_for(lambda: len(router.events.tasks) == 2, what="both event sources subscribed")
        url = f"http://127.0.0.1:{bound_port(server)}"
        chosen = set()
        for i in range(6):
            code, head, body = complete(url, f"through the router {i}")
            assert code == 200, body
            picked = head["x-kvmesh-endpoint"].rsplit("#dp", 1)[1]
            assert head["x-data-parallel-rank"] == picked  # the rank the router pinned
            chosen.add(picked)
        assert chosen == {"0", "1"}


def test_a_killed_rank_is_skipped_and_its_requests_fail(dp2) -> None:
    """Without expert parallelism the other rank keeps serving; /health reports the loss."""
    victim = dp2.ranks[1]
    lines = stream_lines(dp2.url, "long", rank=1, max_tokens=480, ignore_eos=True)
    assert next(lines)  # the stream is under way on rank 1
    victim.kill()
    rest = list(lines)
    assert json.loads(rest[-2])["error"]["code"] == 503 and rest[-1] == "[DONE]"
    wait_for(lambda: http(dp2.url + "/health")[0] == 503, 5, "health 503")
    assert "rank 1" in json.loads(http(dp2.url + "/health")[2])["error"]["message"]
    code, head, _ = complete(dp2.url, "still served")
    assert code == 200 and head["x-data-parallel-rank"] == "0"
    assert complete(dp2.url, "pinned to the dead", rank=1)[0] == 503
    assert dp2.proc.poll() is None


EPLB = {"num_redundant_experts": 2, "step_interval": 6, "window_size": 6}
TOP_K = 2  # the tiny MoE's num_experts_per_tok


@pytest.fixture(scope="module")
def ep2(tiny_moe):
    server = Server(
        "--model", tiny_moe, "--data-parallel-size", "2", "--enable-expert-parallel",
        "--expert-placement-strategy", "round_robin", "--num-gpu-blocks", "64", "--enable-eplb",
        "--eplb-config", json.dumps(EPLB),
    )  # fmt: skip
    yield server
    server.close()


def test_expert_parallel_greedy_equals_one_engine(ep2, tiny_moe) -> None:
    """A mixed batch: two prompts on each rank, the experts split over both (DP2/EP2), and
    EPLB moving them between the ranks every 6 steps: the tokens stay those of one engine."""
    answers = concurrent_texts(ep2.url, PROMPTS, [0, 1, 0, 1])
    assert [rank for _, rank in answers] == ["0", "1", "0", "1"]
    assert [text for text, _ in answers] == one_engine_texts(tiny_moe, PROMPTS)
    rebalances = [metric(ep2.url, "kvmesh:eplb_rebalances_total", r) for r in (0, 1)]
    assert rebalances[0] == rebalances[1] >= 1  # all ranks rebalance together


def test_expert_load_is_exported_per_rank(ep2) -> None:
    def pairs(rank: int, layer: int) -> float:
        return metric(ep2.url, "kvmesh:moe_expert_tokens_total", rank, layer=str(layer))

    before = {(r, layer): pairs(r, layer) for r in (0, 1) for layer in (0, 1)}
    code, _, body = complete(ep2.url, "expert load, counted exactly", rank=0, max_tokens=9)
    assert code == 200
    forwarded = body["usage"]["prompt_tokens"] + 9 - 1  # the last token is never run
    for layer in (0, 1):  # every token of rank 0 went to TOP_K experts in each MoE layer
        assert pairs(0, layer) - before[0, layer] == TOP_K * forwarded
        assert pairs(1, layer) == before[1, layer]  # rank 1 only ran idle steps
    for rank in (0, 1):
        shares = [
            metric(ep2.url, "kvmesh:moe_rank_tokens", rank, layer="0", dst_rank=str(d))
            for d in (0, 1)
        ]
        assert all(n >= 0 for n in shares)
        assert metric(ep2.url, "kvmesh:moe_imbalance", rank) >= 1.0


def test_expert_parallel_ranks_step_in_lockstep(ep2) -> None:
    steps = "kvmesh:dp_lockstep_steps_total"
    idle = "kvmesh:dp_idle_steps_total"
    before = {r: (metric(ep2.url, steps, r), metric(ep2.url, idle, r)) for r in (0, 1)}
    code, _, _ = complete(ep2.url, "only rank 0 works", rank=0, max_tokens=10)
    assert code == 200
    after = {r: (metric(ep2.url, steps, r), metric(ep2.url, idle, r)) for r in (0, 1)}
    busy = after[0][0] - before[0][0]
    assert busy >= 10  # one step per token at least (prefill + decodes)
    assert after[1][0] - before[1][0] == busy  # every step, both ranks stepped
    assert after[1][1] - before[1][1] == busy  # rank 1 idle in each of them
    assert after[0][1] == before[0][1]


def test_a_killed_lockstep_rank_stops_the_server(ep2) -> None:
    """With expert parallelism the peers cannot step alone: errors, health 503, exit 1."""
    lines = stream_lines(ep2.url, "long", rank=0, max_tokens=480, ignore_eos=True)
    assert next(lines)
    ep2.ranks[1].kill()
    rest = list(lines)
    assert "error" in json.loads(rest[-2]) and rest[-1] == "[DONE]"
    assert ep2.proc.wait(timeout=15) == 1
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ep2.ranks)


def test_external_lb_ranks_are_servers_of_their_own(tiny_moe, tmp_path) -> None:
    """`--data-parallel-rank R` per server (vLLM's external LB): each its own port, metrics and
    KV events, in one lockstep group that rank 0 hosts."""
    from tests.helpers import free_port

    rpc = str(free_port())
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv"})
    common = ("--model", tiny_moe, "--data-parallel-size", "2", "--enable-expert-parallel",
              "--data-parallel-rpc-port", rpc, "--num-gpu-blocks", "64",
              "--kv-events-config", events)  # fmt: skip
    servers: list[Server] = []
    with ThreadPoolExecutor(2) as pool:  # both at once: each waits for the other to join
        futures = [pool.submit(Server, *common, "--data-parallel-rank", str(r)) for r in (0, 1)]
        try:
            servers = [f.result() for f in futures]
            urls = [s.url for s in servers]
            assert urls[0] != urls[1]
            _, _, raw = http(urls[1] + "/kv_event_sources")
            sources = json.loads(raw)
            assert list(sources) == ["1"]
            assert sources["1"]["endpoint"] == f"ipc://{tmp_path}/kv_dp1"  # its own, port + rank
            steps = "kvmesh:dp_lockstep_steps_total"
            before = metric(urls[1], steps, 1)
            assert metric(urls[1], steps, 0) == 0  # rank 1's page has only its own series
            texts = [
                complete(url, p)[2]["choices"][0]["text"]
                for url, p in zip(urls, PROMPTS[:2], strict=True)
            ]
            assert all(texts)
            assert metric(urls[1], steps, 1) - before >= 8  # it stepped for rank 0's request too
        finally:
            for future in futures:
                if future.exception() is None:
                    future.result().close()
