"""`kvmesh bench fleet --quick` end to end: 2 emulated engines started through the CLI, a router
per policy (round-robin, kvmesh), the same agentic workload through each."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from kvmesh.bench import fleet, loadgen


def test_parse_counters_sums_series() -> None:
    page = (
        "# HELP vllm:prefix_cache_hits_total x\n"
        'vllm:prefix_cache_hits_total{engine="0"} 32.0\n'
        'vllm:prefix_cache_hits_total{engine="1"} 16.0\n'
        'vllm:prefix_cache_queries_total{engine="0"} 100.0\n'
        "vllm:prefix_cache_hits_created 1.7e9\n"
    )
    got = loadgen.parse_counters(page)
    assert got["hits"] == 48 and got["queries"] == 100 and got["preemptions"] == 0


def test_load_of_a_router_that_names_no_endpoint_comes_from_the_engines() -> None:
    """Peer routers do not say where a request went: the engines' finished-request counters
    give the per-engine load instead of the router's own URL."""
    engines = ["http://e0", "http://e1"]
    recs = [loadgen.Record(i, 0.0, endpoint="http://router") for i in range(4)]
    before = {u: {"requests": 0.0, "busy_s": 0.0} for u in engines}
    after = {"http://e0": {"requests": 3.0, "busy_s": 1.0}, "http://e1": {"requests": 1.0}}
    s = loadgen.summarize(recs, 2.0, before, after, engines)
    assert s["load"] == {"http://e0": 3, "http://e1": 1} and s["load_max_mean"] == 1.5
    named = [loadgen.Record(i, 0.0, endpoint=engines[i % 2]) for i in range(4)]
    assert loadgen.summarize(named, 2.0, before, after, engines)["load_max_mean"] == 1.0


def test_quick_fleet_run(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    fleet.add_args(parser)
    args = ["--quick", "--emulate-time-scale", "2", "--out", str(tmp_path)]
    assert fleet.main(parser.parse_args(args)) == 0
    result = json.loads((tmp_path / "fleet.json").read_text())
    assert result["time_scale"] == 2.0 and "slow motion x2" in result["title"]
    assert (tmp_path / "fleet.png").stat().st_size > 0
    assert list(result["policies"]) == ["round-robin", "kvmesh"]
    assert len(result["engines"]) == 2
    assert not [s for s in result["skipped"] if "not reset" in s]
    ceiling = result["ceiling"]["hit_rate"]
    assert 0.5 < ceiling < 1
    n = result["workload"]["requests"]
    for s in result["policies"].values():
        assert s["requests"] == n and s["errors"] == 0
        assert 0 < s["hit_rate"] <= ceiling + 0.02
        assert s["ttft_ms_p50"] > 0 and s["itl_ms_p50"] > 0 and s["output_tok_s"] > 0
        assert sum(s["load"].values()) == n and set(s["load"]) == set(result["engines"])
        assert s["load_max_mean"] >= 1
        assert s["engine_hit_rate"] is not None and s["preemptions"] == 0
        # the client's view of the cache (usage.cached_tokens) agrees with the engines' metrics
        assert abs(s["engine_hit_rate"] - s["hit_rate"]) < 0.02


def test_engine_variant_reruns_policies_on_fresh_engines(tmp_path: Path) -> None:
    """--engine-variant restarts the fleet with extra serve flags and labels its rows
    POLICY@NAME; prompts go as token ids; each row keeps the engines' step timing."""
    parser = argparse.ArgumentParser()
    fleet.add_args(parser)
    flags = "--kv-offloading-size 0.25"
    # a smaller workload than --quick's (4 requests: turn 2 of each session reuses turn 1)
    args = ["--quick", "--policies", "kvmesh", "--prompt-format", "ids", "--engine-variant",
            f"host={flags}", "--sessions", "2", "--turns", "2", "--fanout", "0",
            "--out", str(tmp_path)]  # fmt: skip
    assert fleet.main(parser.parse_args(args)) == 0
    result = json.loads((tmp_path / "fleet.json").read_text())
    assert list(result["policies"]) == ["kvmesh", "kvmesh@host"]
    assert result["engine_variants"] == {"host": flags}
    assert (tmp_path / "engines-host.log").is_file()
    for s in result["policies"].values():
        assert s["errors"] == 0 and s["hit_rate"] > 0  # token-id prompts reuse their prefixes
        assert s["timing"]["steps"] > 0
    bad = parser.parse_args(["--engine-variant", "nameonly", "--out", str(tmp_path)])
    assert fleet.main(bad) == 2


def test_single_url_agentic_command(tmp_path: Path, tokenizer) -> None:
    from kvmesh.cli import build_parser
    from tests.conftest import emulated_fleet

    with emulated_fleet(tokenizer) as (urls, _):
        args = build_parser().parse_args(
            ["bench", "agentic", "--url", urls[0], "--engine-metrics", urls[0], "--out",
             str(tmp_path), "--sessions", "2", "--turns", "2", "--fanout", "0", "--think-s", "0",
             "--repo-tokens", "300", "--system-tokens", "200", "--tool-def-tokens", "100"]
        )  # fmt: skip
        assert args.func(args) == 0
    doc = json.loads((tmp_path / "agentic.json").read_text())
    r = doc["result"]
    assert r["requests"] == doc["workload"]["requests"] == 4 and r["errors"] == 0
    assert 0 < r["hit_rate"] <= doc["ceiling"]["hit_rate"] + 0.02  # turn 2 reuses turn 1
    assert abs(r["engine_hit_rate"] - r["hit_rate"]) < 0.02
    rows = json.loads((tmp_path / "agentic.rows.json").read_text())  # each request as it ended
    assert rows["status"] == "complete" and rows["rows_done"] == rows["rows_total"] == 4
    assert sorted(x["rid"] for x in rows["rows"]) == sorted(range(4))
    assert all(x["ttft_ms"] > 0 and "error" not in x for x in rows["rows"])


def test_engines_without_reset_get_fresh_prompts_per_policy(monkeypatch, tmp_path: Path) -> None:
    """Real vLLM outside dev mode has no /reset_prefix_cache: each later policy then runs the
    same workload shape in words of its own, so no policy meets another's warm cache."""
    from kvmesh.bench.fleet_procs.routers import Target
    from kvmesh.bench.workloads import shared_prefix

    seen: list[tuple[int, str]] = []

    class Router:
        def stop(self) -> None:
            pass

    async def run_workload(url, wl, **kw):
        seen.append((wl.seed, wl.text(wl.requests[0])))
        return {"label": kw["label"]}

    monkeypatch.setattr(fleet, "reset_caches", lambda urls: [f"{urls[0]}: HTTP 404"])
    monkeypatch.setattr(fleet, "start_router", lambda *a: (Router(), "http://r"))
    monkeypatch.setattr(fleet, "router_metrics", lambda url: {})
    monkeypatch.setattr(fleet, "kv_move_counters", lambda urls: {})
    monkeypatch.setattr(fleet, "engine_timing", lambda urls: {})
    monkeypatch.setattr(loadgen, "run_workload", run_workload)
    wl = shared_prefix(groups=2, prompts_per_group=2, system_tokens=20, question_tokens=5)
    args = argparse.Namespace(
        concurrency=2, request_timeout=10, time_scale_used=1.0, prompt_format="text"
    )
    targets = [Target("kvmesh", "round-robin"), Target("kvmesh", "kvmesh")]
    rows, notes = fleet.run_policies(args, wl, ["http://e"], targets, {}, tmp_path, None)
    assert set(rows) == {"round-robin", "kvmesh"}
    assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1]
    assert any("ran on its own prompts" in n for n in notes)


def test_router_port_puts_the_policies_routers_on_chosen_ports(monkeypatch, tmp_path) -> None:
    """--router-port P: the i-th policy's router on P + i; unset, a free port each (0)."""
    from kvmesh.bench.fleet_procs.routers import Target

    ports: list[int] = []

    class Router:
        def stop(self) -> None:
            pass

    def start_router(t, urls, prefix, bins, out, port=0):
        ports.append(port)
        return Router(), "http://r"

    async def run_workload(url, wl, **kw):
        return {"label": kw["label"]}

    monkeypatch.setattr(fleet, "reset_caches", lambda urls: [])
    monkeypatch.setattr(fleet, "kvmesh_engines", lambda urls: [])
    monkeypatch.setattr(fleet, "start_router", start_router)
    monkeypatch.setattr(fleet, "router_metrics", lambda url: {})
    monkeypatch.setattr(fleet, "kv_move_counters", lambda urls: {})
    monkeypatch.setattr(loadgen, "run_workload", run_workload)
    targets = [Target("kvmesh", "round-robin"), Target("kvmesh", "kvmesh")]
    for given in (9100, 0):
        args = argparse.Namespace(
            concurrency=1,
            request_timeout=10,
            time_scale_used=1.0,
            prompt_format="text",
            router_port=given,
        )
        fleet.run_policies(args, None, ["http://e"], targets, {}, tmp_path, None)
    assert ports == [9100, 9101, 0, 0]


def test_start_healthy_listens_on_the_port_given(tmp_path) -> None:
    import sys

    from kvmesh.bench.fleet_procs.procs import start_healthy
    from tests.helpers import free_port

    server = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    port = free_port()
    proc, url = start_healthy(
        lambda p: [sys.executable, "-c", server, str(p)], tmp_path / "r.log", "r", port=port
    )
    try:
        assert url == f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def test_without_reset_every_policy_gets_prompts_no_other_shares(monkeypatch, tmp_path) -> None:
    """No /reset_prefix_cache (vLLM outside dev mode): no request of one policy shares even a
    short prefix with a request of another, so none can hit another's cached blocks."""
    from kvmesh.bench.fleet_procs.routers import Target
    from kvmesh.bench.workloads import agentic

    prefixes: dict[str, set[str]] = {}

    class Router:
        def stop(self) -> None:
            pass

    async def run_workload(url, wl, **kw):
        prefixes[kw["label"]] = {" ".join(wl.text(r).split()[:8]) for r in wl.requests}
        return {"label": kw["label"]}

    monkeypatch.setattr(fleet, "reset_caches", lambda urls: [f"{urls[0]}: HTTP 404"])
    monkeypatch.setattr(fleet, "kvmesh_engines", lambda urls: [])
    monkeypatch.setattr(fleet, "start_router", lambda *a: (Router(), "http://r"))
    monkeypatch.setattr(fleet, "router_metrics", lambda url: {})
    monkeypatch.setattr(fleet, "kv_move_counters", lambda urls: {})
    monkeypatch.setattr(loadgen, "run_workload", run_workload)
    wl = agentic(**fleet.QUICK["agentic"])
    args = argparse.Namespace(
        concurrency=2, request_timeout=10, time_scale_used=1.0, prompt_format="text"
    )
    names = ("round-robin", "load", "kvmesh")
    targets = [Target("kvmesh", name) for name in names]
    fleet.run_policies(args, wl, ["http://e"], targets, {}, tmp_path, None)
    assert set(prefixes) == set(names)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not prefixes[a] & prefixes[b], (a, b)


async def test_busy_is_read_only_from_kvmesh_engines_and_shown_unknown_else() -> None:
    """vLLM engines are not asked kvmesh's /admin/timing, and their busy time reads "-", not
    0%; with no engine metrics at all, preemptions read "-" too."""
    import aiohttp
    from aiohttp import web

    from kvmesh.bench.engine_probes import kvmesh_engines

    asked: list[str] = []

    def engine(owner: str) -> web.Application:
        app = web.Application()

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "m", "owned_by": owner}]})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="vllm:num_preemptions_total 0.0\n")

        async def timing(_: web.Request) -> web.Response:
            asked.append(owner)
            return web.json_response({"predicted_step_s_sum": 1.0})

        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/admin/timing", timing)
        return app

    runners, urls = [], []
    for owner in ("vllm", "kvmesh"):
        runner = web.AppRunner(engine(owner))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        timed = await asyncio.to_thread(kvmesh_engines, urls)
        assert timed == urls[1:]
        async with aiohttp.ClientSession() as http:
            got = await loadgen.scrape_engines(http, urls, timed)
        assert asked == ["kvmesh"] and "busy_s" not in got[urls[0]] and got[urls[1]]["busy_s"]
    finally:
        for runner in runners:
            await runner.cleanup()
    recs = [loadgen.Record(0, 0.0, endpoint=urls[0])]
    vllm_only = {urls[0]: got[urls[0]]}
    s = loadgen.summarize(recs, 1.0, vllm_only, vllm_only, urls[:1])
    assert s["busy_mean"] is None and s["preemptions"] == 0
    blind = loadgen.summarize(recs, 1.0, {}, {}, [])
    assert blind["busy_mean"] is None and blind["preemptions"] is None
    table = loadgen.table([("vllm", s), ("blind", blind)], 0.5, "t")
    cells = {c.header: list(c.cells) for c in table.columns}
    assert cells["busy"] == ["-", "-"] and cells["preempt"] == ["0", "-"]


def test_a_run_with_failed_requests_says_so_first_and_shows_no_ratio() -> None:
    from kvmesh.bench.fleet import check_targets

    ok = [loadgen.Record(i, 0.0, prompt_tokens=100, cached_tokens=90) for i in range(2)]
    bad = [loadgen.Record(i, 0.0, error="HTTP 504: upstream stream stalled") for i in range(10)]
    survivors = loadgen.summarize(ok + bad, 1.0, {}, {}, [])
    clean = loadgen.summarize(ok, 1.0, {}, {}, [])
    rows = [("kvmesh", survivors), ("round-robin", clean)]
    assert loadgen.failures(rows) == [
        "kvmesh: 10 of 12 requests failed (HTTP 504: upstream stream stalled)"
    ]
    cells = {c.header: list(c.cells) for c in loadgen.table(rows, 0.5, "t").columns}
    assert [c.header for c in loadgen.table(rows, 0.5, "t").columns][:2] == ["policy", "failed"]
    assert cells["hit rate"] == ["-", "0.900"] and cells["of ceiling"] == ["-", "180%"]
    targets = check_targets("agentic", 0.5, dict(rows))
    assert targets == {"failed": ["kvmesh"]}  # no ratio from the survivors
