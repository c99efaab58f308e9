"""The measures bench and sim share (issue 17, "logic lives once"): one percentile, one Mooncake
trace conversion, one hit-rate ceiling and one Prometheus text parser, each checked against a
reference and through the callers that report it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.bench import loadgen
from kvmesh.bench import workloads as w
from kvmesh.protocol.ceiling import block_contents, hit_ceiling, max_hit_blocks, runs_of
from kvmesh.protocol.prom import parse_engine_load, parse_samples
from kvmesh.protocol.stats import percentile
from kvmesh.protocol.trace import TRACE_BLOCK, arrival_offsets, parse_row, read_trace
from kvmesh.sim import replay
from kvmesh.sim.fleet import SimRecord


def _scheduling_script():
    from tests.test_bench_router_path import script

    return script("router_scheduling")


# --- percentiles --------------------------------------------------------------------------

finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100))
def test_percentile_is_numpys_linear_method(values: list[float], q: float) -> None:
    want = float(np.percentile(values, q, method="linear"))
    assert percentile(values, q) == pytest.approx(want, rel=1e-12, abs=1e-9)
    assert min(values) <= percentile(iter(values), q) <= max(values)


def test_percentile_hand_values_and_edges() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5  # the median: between the two middle values
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)  # not the maximum (100)
    assert percentile([5.0], 99) == 5.0 and percentile([], 90) == 0.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_bench_and_sim_report_the_same_percentiles() -> None:
    ms = [float(x) for x in range(1, 101)]
    want = {q: percentile(ms, q) for q in (50, 90, 99)}
    records = [loadgen.Record(i, 0.0, ttft=v / 1000, e2e=v / 1000) for i, v in enumerate(ms)]
    bench = loadgen.summarize(records, 1.0, {}, {}, [])
    sims = [SimRecord(i, 0, 0.0, 10, first_token=v / 1000, finished=1.0) for i, v in enumerate(ms)]
    sim = replay.summarize(sims, 1)
    micro = _scheduling_script().summarize(ms)  # benchmarks/router_scheduling.py
    for q in (50, 90, 99):
        assert bench[f"ttft_ms_p{q}"] == pytest.approx(want[q], abs=0.01)
        assert sim[f"ttft_ms_p{q}"] == pytest.approx(want[q], abs=0.1)
    assert micro["p50"] == pytest.approx(want[50]) and micro["p99"] == pytest.approx(want[99])


# --- the Mooncake trace -------------------------------------------------------------------

ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1536, "output_length": 0, "hash_ids": [0, 1, 5]},
    {"timestamp": 1500, "input_length": 700, "output_length": 9, "hash_ids": [7]},  # a tail
    {"timestamp": 2500, "input_length": 300, "output_length": 2, "hash_ids": [0]},
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_trace_rows_become_token_prompts(trace) -> None:
    rows = read_trace(trace)
    ids = [r.token_ids() for r in rows]
    assert [len(t) for t in ids] == [r["input_length"] for r in ROWS]
    # the same hash id is the same tokens wherever it appears
    assert ids[0][:1024] == ids[1][:1024] and ids[3] == ids[0][:300]
    # sharing the first k hash ids is sharing exactly the first k * 512 tokens
    assert _shared_prefix(ids[0], ids[1]) == 2 * TRACE_BLOCK
    assert _shared_prefix(ids[0], ids[2]) == 0
    # the row with fewer hash ids than its length: 512 block tokens, then its own 188
    tail = ids[2][TRACE_BLOCK:]
    assert len(tail) == 188 and not set(tail) & {t for i in (0, 1, 3) for t in ids[i]}
    assert [r.max_tokens for r in rows] == [3, 1, 9, 2]
    assert arrival_offsets(rows, 2.0) == [0.0, 1.0, 3.0, 5.0]
    assert arrival_offsets(rows, rate=1.2) == pytest.approx([0.0, 0.5, 1.5, 2.5])


def test_bench_and_sim_convert_the_trace_alike(trace) -> None:
    bench = w.mooncake(trace, time_scale=0.5, max_output=4)
    sim = replay.trace_requests(str(trace), time_scale=0.5)
    assert len(bench.requests) == len(sim) == len(ROWS)
    for b, s in zip(bench.requests, sim, strict=True):
        assert tuple((int(key.removeprefix("ids")), n) for key, n in b.prompt) == s.prompt
        assert b.at == pytest.approx(s.at)
        assert b.max_tokens == min(4, s.max_tokens)
    words = [bench.text(r).split() for r in bench.requests[:2]]
    assert words[0][:1024] == words[1][:1024] and words[0][1024:] != words[1][1024:1100]
    window = read_trace(trace, limit=2, start=1)
    assert [r.line for r in window] == [1, 2] and window[1].token_runs() == sim[2].prompt


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}', "input"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}', "time"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', "output_length"),
        ("[1, 2]", "object"),
        ("{oops", "JSON"),
    ],
)
def test_bad_trace_rows_are_refused_by_line(line: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"trace line 8: .*{field}"):
        parse_row(line, 7)


# --- the hit-rate ceiling -----------------------------------------------------------------


def _reference_ceiling(prompts: list[list[int]], block_size: int) -> int:
    """Brute force: a block hits when the same whole prefix up to its end was cached before."""
    cached: set[tuple[int, ...]] = set()
    hit = 0
    for ids in prompts:
        run, limit = 0, (len(ids) - 1) // block_size
        while run < limit and tuple(ids[: (run + 1) * block_size]) in cached:
            run += 1
        hit += run * block_size
        cached.update(tuple(ids[:end]) for end in range(block_size, len(ids) + 1, block_size))
    return hit


def test_ceiling_hand_cases() -> None:
    def hits(prompts: list[list[int]], bs: int = 16) -> int:
        return hit_ceiling([runs_of(p) for p in prompts], bs).hit_tokens

    p64 = list(range(64))
    assert hits([p64]) == 0  # nothing before the first
    assert hits([p64, p64]) == 48  # an exact multiple: its last block is always computed
    assert hits([p64, [*p64, 999]]) == 64  # one token more: all four blocks hit
    assert hits([p64, p64[:40] + [999] * 24]) == 32  # only whole blocks before the change
    assert hits([p64, [999] * 16 + p64[16:]]) == 0  # equal blocks after a different prefix
    assert hits([[1] * 5, [1] * 5]) == 0  # shorter than a block
    assert [max_hit_blocks(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]
    got = hit_ceiling([((0, 64),), ((0, 10), (10, 54), (500, 1))], 16)
    assert (got.hit_tokens, got.prompt_tokens, got.hit_rate) == (64, 129, 64 / 129)


def test_block_contents_depend_on_tokens_not_on_how_runs_are_cut() -> None:
    whole = block_contents(((100, 48),), 16)
    assert block_contents(((100, 7), (107, 30), (137, 11)), 16) == whole
    assert block_contents(runs_of(list(range(100, 148))), 16) == whole
    assert len(block_contents(((0, 47),), 16)) == 2  # only full blocks


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=6),
    st.sampled_from([1, 2, 4, 8]),
)
def test_ceiling_matches_brute_force(prompts: list[list[int]], block_size: int) -> None:
    got = hit_ceiling([runs_of(p) for p in prompts], block_size)
    assert got.hit_tokens == _reference_ceiling(prompts, block_size)
    assert got.prompt_tokens == sum(map(len, prompts))


def test_bench_and_sim_ceilings_are_one_function(trace) -> None:
    wl = w.mooncake(trace)
    sim = replay.trace_requests(str(trace))
    want = hit_ceiling([s.prompt for s in sim], 16)
    assert w.hit_ceiling(wl.requests, 16) == want.as_dict()
    assert replay.hit_ceiling(sim, 16) == want.hit_rate
    # rows 1 and 3 reuse row 0's blocks: 1024 tokens of row 1, 288 of row 3's 300
    assert want.hit_tokens == 1024 + 288
    ag = w.agentic(sessions=2, turns=3, repos=1, repo_tokens=300, seed=2)
    from kvmesh.sim.requests import workload_requests

    assert replay.hit_ceiling(workload_requests(ag), 16) == w.hit_ceiling(ag.requests)["hit_rate"]


# --- Prometheus text ----------------------------------------------------------------------


def _page() -> str:
    r = CollectorRegistry()
    g = Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=r)
    g.labels("m", "0").set(2)
    g.labels('odd "name"\\ with\nnewline', "1").set(float("inf"))
    c = Counter("kvmesh:kv_offload_hits", "h", ["medium"], registry=r)
    c.labels("CPU").inc(7)
    Gauge("plain", "p", registry=r).set(float("nan"))
    return generate_latest(r).decode()


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_samples_equal_prometheus_clients_parser() -> None:
    from kvmesh.engine.metrics import EngineMetrics

    m = EngineMetrics("model")
    m.ttft.observe(0.3)
    m.request_finished("stop")
    for page in (_page(), m.render().decode()):
        ref = [s for f in text_string_to_metric_families(page) for s in f.samples]
        got = list(parse_samples(page))
        assert [(s.name, s.labels) for s in got] == [(s.name, s.labels) for s in ref]
        assert all(_same(a.value, b.value) for a, b in zip(got, ref, strict=True))
        lines = [ln.rsplit(" ", 1)[0] for ln in page.splitlines() if not ln.startswith("#")]
        assert [s.series() for s in got] == [ln for ln in lines if ln]


def test_samples_skip_what_does_not_parse_and_drop_timestamps() -> None:
    page = (
        "# TYPE x gauge\n\n"
        'x{a="1"} 3 1700000000000\n'  # a timestamp: not the value
        "x 4\n"
        'x{a="1" 5\n'  # no closing brace
        "x{a=1} 6\n"  # an unquoted label value
        "x-y 7\n"  # not a name
        "x nope\n"
        '  x{a="2",} +Inf  \n'  # a trailing comma and spaces are allowed
    )
    got = [(s.name, s.labels, s.value) for s in parse_samples(page)]
    assert got == [("x", {"a": "1"}, 3.0), ("x", {}, 4.0), ("x", {"a": "2"}, math.inf)]
    assert list(parse_samples(page, keep=lambda name: name != "x")) == []


def test_engine_load_reads_gauges_with_a_timestamp() -> None:
    page = (
        'vllm:num_requests_waiting{engine="0"} 2 1700000000000\n'
        'vllm:num_requests_waiting{engine="1"} 3\n'
        "vllm:num_requests_running 4\n"
        'vllm:gpu_cache_usage_perc{engine="0"} 0.5\n'
    )
    assert parse_engine_load(page) == (5.0, 4.0, 0.5)
    assert parse_engine_load(_page()).waiting == math.inf


def test_engine_load_reads_only_its_gauges_as_the_full_parse_would() -> None:
    """The scan for the load gauges' lines gives what parse_samples over the page gives."""
    lines = [
        "# HELP vllm:num_requests_waiting Requests waiting. vllm:num_requests_running 9",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0',  # a longer name
        'xvllm:num_requests_running{engine="0"} 8.0',  # ends with a wanted name
        '  vllm:num_requests_waiting{engine="1"} 3.0 1700000000000',  # blanks, a timestamp
        "vllm:num_requests_running nope",  # does not parse: skipped
        'vllm:num_requests_running{engine="1"} 4.0',
        'vllm:kv_cache_usage_perc{engine="0"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1"} 0.75',
        'vllm:gpu_cache_usage_perc{engine="0"} 0.9',  # the older name: read only when alone
    ]
    for sep in ("\n", "\r\n"):
        page = sep.join(lines) + sep
        assert parse_engine_load(page) == (5.0, 4.0, 0.5)
        full = {}
        for s in parse_samples(page):
            full.setdefault(s.name, []).append(s.value)
        assert parse_engine_load(page).waiting == sum(full["vllm:num_requests_waiting"])
    older = "\n".join(line for line in lines if "kv_cache" not in line)
    assert parse_engine_load(older).kv_usage == 0.9
    assert parse_engine_load("") == (0.0, 0.0, 0.0)
