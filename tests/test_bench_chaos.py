"""`kvmesh bench chaos`: its help, the report's arithmetic on synthetic requests and metrics
samples (no processes), and a short run of every phase on two emulated engines."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from kvmesh.bench import chaos
from kvmesh.bench.chaos_metrics import (
    Sample,
    counter_increase,
    eject_readmit,
    parse_router_metrics,
    warm_time,
)
from kvmesh.bench.chaos_report import Phase, Result, assemble, by_phase, window_hit
from kvmesh.cli import build_parser


def test_help_explains_phases_and_outputs(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "chaos", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in (*chaos.PHASES, "lost before the first token", "broken after the first token"):
        assert phrase in text
    for phrase in ("hit rate", "re-admission", "98%", "chaos.json", "chaos.png", "--quick"):
        assert phrase in text


def _r(start: float, end: float, ttft: float | None, error: str = "", p: int = 100, c: int = 0):
    return Result(start, end, ttft, p, c, error)


def test_outcomes_and_hit_rate_by_phase() -> None:
    phases = [Phase("baseline", 0.0, 10.0), Phase("errors", 10.0, 20.0, "http://e1")]
    results = [
        _r(1.0, 2.0, 10.0, c=80),  # ok
        _r(2.0, 3.0, 12.0, c=60),  # ok
        _r(3.0, 4.0, None, "HTTP 503: no endpoint"),  # lost: an error status, no token
        _r(9.0, 11.0, 20.0, "ClientPayloadError: cut"),  # broken, charged to where it ended
        _r(12.0, 13.0, None, "ClientConnectorError: refused"),  # lost: no connection
        _r(14.0, 15.0, 30.0, c=100, p=200),  # ok
    ]
    assert [r.outcome for r in results] == ["ok", "ok", "lost", "broken", "lost", "ok"]
    base, err = by_phase(results, phases)
    assert (base["requests"], base["ok"], base["lost"], base["broken"]) == (3, 2, 1, 0)
    assert (err["requests"], err["ok"], err["lost"], err["broken"]) == (3, 1, 1, 1)
    # only finished requests carry usage: (80 + 60) / (100 + 100) and 100 / 200
    assert base["hit_rate"] == 0.7 and err["hit_rate"] == 0.5
    assert base["ttft_ms_p50"] == 11.0 and err["ttft_ms_p50"] == 25.0  # broken ones had a token
    assert window_hit(results, 0.0, 2.5) == (0.7, 2) and window_hit(results, 5.0, 8.0)[1] == 0
    # a request retried while the router was down counts where its last attempt was routed
    retried = Result(4.0, 7.0, 2500.0, 100, 30, retries=3, sent=6.0)
    assert retried.outcome == "ok" and window_hit([retried], 5.0, 8.0) == (0.3, 1)
    assert by_phase([retried], phases)[0]["retried"] == 1


def _metrics(healthy: dict[str, int], precise: float, ejected: dict[str, int] = ()) -> str:
    lines = [f'kvmesh_router_endpoint_healthy{{endpoint="{e}"}} {v}' for e, v in healthy.items()]
    lines += [
        f'kvmesh_router_endpoint_ejected{{endpoint="{e}"}} {v}' for e, v in dict(ejected).items()
    ]
    lines += [f'kvmesh_router_index_entries{{index="precise"}} {precise}']
    lines += ["# TYPE kvmesh_router_endpoint_ejections counter"]
    lines += ['kvmesh_router_endpoint_ejections_total{endpoint="e0",reason="5xx"} 2.0']
    lines += ['kvmesh_router_endpoint_ejections_created{endpoint="e0",reason="5xx"} 1.7e9']
    return "\n".join(lines) + "\n"


def test_parses_the_routers_own_metrics_page() -> None:
    from kvmesh.router.metrics import RouterMetrics

    m = RouterMetrics()
    m.healthy.labels("http://e0").set(1)
    m.healthy.labels("http://e1").set(0)
    m.index_entries.labels("precise").set(7)
    m.readmissions.labels("http://e0", "reachable").inc()
    m.kv_index_warm.labels("http://e0").set(1)
    m.kv_index_warm_seconds.labels("http://e0").set(0.25)
    s = parse_router_metrics(m.render().decode(), 3.0)
    assert s.t == 3.0 and s.healthy == {"http://e0": 1.0, "http://e1": 0.0} and s.precise == 7.0
    assert s.warm == {"http://e0": 1.0} and s.warm_s == {"http://e0": 0.25}
    key = "kvmesh_router_endpoint_readmissions_total{endpoint=http://e0,reason=reachable}"
    assert s.extras == {key: 1.0}


def test_metrics_eject_readmit_and_warm() -> None:
    s = parse_router_metrics(_metrics({"e0": 1, "e1": 1}, 50, {"e1": 1}))
    assert s.healthy == {"e0": 1.0, "e1": 0.0} and s.precise == 50.0  # ejected: out of rotation
    assert s.extras == {"kvmesh_router_endpoint_ejections_total{endpoint=e0,reason=5xx}": 2.0}
    # killed at 1.0, out at 1.2, restarted at 3.0, back at 4.5; router down 5..6 (no answer)
    states = [(0.5, 1), (1.0, 1), (1.2, 0), (2.0, 0), (3.0, 0), (4.5, 1), (6.0, 1), (7.0, 1)]
    samples = [Sample(t, {"e0": v}, float(i * 10)) for i, (t, v) in enumerate(states)]
    samples.insert(6, Sample(5.0))
    got = eject_readmit(samples, "e0", 1.0, 3.0)
    assert got["eject_s"] == pytest.approx(0.2) and got["readmit_s"] == pytest.approx(1.5)
    assert got["ejections"] == 1
    never = eject_readmit(samples, "e1", 1.0, 3.0)
    assert never["eject_s"] is None and never["readmit_s"] is None and never["ejections"] == 0
    assert warm_time(samples, 52.0, 4.0) == pytest.approx(2.0)  # 60 >= 0.98 x 52 at 6.0
    assert warm_time(samples, 1000.0, 4.0) is None


def _counted(t: float, ejections: int, readmissions: int, ep: str = "e0") -> Sample:
    extras = {f"kvmesh_router_endpoint_ejections_total{{endpoint={ep},reason=5xx}}": ejections}
    extras[f"kvmesh_router_endpoint_readmissions_total{{endpoint={ep},reason=x}}"] = readmissions
    extras["kvmesh_router_endpoint_ejections_total{endpoint=e01,reason=5xx}"] = 9 * t  # not e0
    return Sample(t, {ep: 1.0}, None, extras)


def test_counted_ejections_and_readmissions() -> None:
    # the fault 1.0..3.0: ejected and taken back between two polls (the gauge never saw it),
    # then ejected at 2.5 and back at 3.4, after the fault's end
    states = [(0.5, 0, 0), (1.0, 0, 0), (1.5, 1, 1), (2.5, 2, 1), (3.0, 2, 1), (3.4, 2, 2)]
    samples = [_counted(t, e, r) for t, e, r in states]
    samples.insert(4, Sample(2.8))  # the router did not answer: no change
    got = eject_readmit(samples, "e0", 1.0, 3.0)
    assert got["eject_s"] is None and got["ejections"] == 0  # the gauge: always in rotation
    assert (got["ejections_counted"], got["readmissions_counted"]) == (2, 2)
    assert got["readmit_counted_s"] == pytest.approx(0.4)
    # a restarted router (gen 1) counts from zero: its first 1 is an increase
    reset = [_counted(0.5, 1, 1), Sample(1.2), _counted(1.5, 1, 0), _counted(2.0, 1, 1)]
    reset[2].gen = reset[3].gen = 1
    again = eject_readmit(reset, "e0", 1.0, 1.8)
    assert (again["ejections_counted"], again["readmit_counted_s"]) == (1, pytest.approx(0.2))
    # a labelled counter shows at its first increment: that is an increase from zero
    grown = counter_increase([_counted(0.5, 0, 0), _counted(1.0, 0, 0)] + reset[2:], 1.0, 3.0)
    assert grown == {
        "kvmesh_router_endpoint_ejections_total{endpoint=e0,reason=5xx}": 1,
        "kvmesh_router_endpoint_readmissions_total{endpoint=e0,reason=x}": 1,
        "kvmesh_router_endpoint_ejections_total{endpoint=e01,reason=5xx}": 4.5 + 18.0,
    }


def test_assemble_router_restart_and_targets() -> None:
    phases = [Phase("baseline", 0.0, 4.0), Phase("router-restart", 4.0, 8.0)]
    events = [{"t": 4.0, "kind": "router_kill", "target": "r"}]
    events += [{"t": 5.0, "kind": "router_ready", "target": "r"}]
    samples = [Sample(3.9, {}, 100.0), Sample(4.5), Sample(5.2, {}, 10.0), Sample(5.6, {}, 99.0)]
    results = [_r(3.0, 3.5, 5.0, c=90), _r(5.1, 5.5, 5.0, c=85), _r(6.0, 6.5, 5.0, c=90)]
    got = assemble(results, samples, events, phases, look_s=2.0)
    warm = got["router_restart"]
    assert warm["router_down_s"] == 1.0 and warm["index_before"] == 100.0
    assert warm["index_warm_s"] == pytest.approx(0.6)
    # a retried request reaching the new router before its /health was seen: it was up then
    early = Result(3.8, 6.0, 2200.0, 100, 85, retries=9, sent=4.9)
    again = assemble([*results, early], samples, events, phases, 2.0)["router_restart"]
    assert again["router_down_s"] == pytest.approx(0.9) and again["n_first_s"] == 2
    assert again["index_warm_s"] == pytest.approx(0.7)
    assert warm["hit_before"] == 0.9 and warm["hit_first_s"] == 0.85
    assert got["targets"]["lost_ok"] and got["targets"]["index_warm_ok"]
    assert not got["targets"]["hit_first_s_ok"]  # 0.85 < 0.9 - 0.02
    assert [p["name"] for p in got["phases"]] == ["baseline", "router-restart"]
    assert "index_warm_router_s" not in warm  # no feed gauges exported: not reported
    # the router's own feed gauges: warm at 5.6 (all feeds), 0.4 s after subscribing
    samples[2].warm, samples[2].warm_s = {"a": 1.0, "b": 0.0}, {"a": 0.1}
    samples[3].warm, samples[3].warm_s = {"a": 1.0, "b": 1.0}, {"a": 0.1, "b": 0.4}
    feeds = assemble(results, samples, events, phases, look_s=2.0)
    assert feeds["router_restart"]["index_warm_router_s"] == pytest.approx(0.4)
    assert feeds["router_restart"]["index_warm_seen_s"] == pytest.approx(0.6)
    assert feeds["targets"]["index_warm_router_ok"]


@pytest.mark.slow  # about 50 s: two engine and two router starts on a small host
def test_short_run_of_every_phase(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    chaos.add_args(parser)
    argv = ["--quick", "--phase-seconds", "2.5", "--out", str(tmp_path)]
    assert chaos.main(parser.parse_args(argv)) == 0
    result = json.loads((tmp_path / "chaos.json").read_text())
    assert [p["name"] for p in result["phases"]] == list(chaos.PHASES)
    assert result["targets"]["lost_before_first_token"] == 0, result["phases"]
    warm = result["router_restart"]["index_warm_s"]
    assert warm is not None and math.isfinite(warm)
    assert result["totals"]["ok"] > 0 and (tmp_path / "chaos.png").stat().st_size > 0


def test_router_restart_smoke(tmp_path: Path) -> None:
    """The default suite's smoke: a router killed and restarted in front of two engines loses
    no request that had not started, and its index is whole again from the replay sockets."""
    parser = argparse.ArgumentParser()
    chaos.add_args(parser)
    argv = ["--quick", "--phases", "baseline,router-restart", "--phase-seconds", "2"]
    assert chaos.main(parser.parse_args([*argv, "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "chaos.json").read_text())
    assert [p["name"] for p in result["phases"]] == ["baseline", "router-restart"]
    assert result["targets"]["lost_before_first_token"] == 0, result["phases"]
    assert result["targets"]["index_warm_ok"], result["router_restart"]
    rows = json.loads((tmp_path / "chaos.rows.json").read_text())  # saved as each phase ended
    assert rows["status"] == "complete" and rows["rows_done"] == rows["rows_total"] == 2
    assert [r["name"] for r in rows["rows"]] == ["baseline", "router-restart"]


def test_a_retried_request_is_lost_to_a_client_without_retries() -> None:
    """The retrying client (the OpenAI SDK's way, while the router is down) and a client that
    never retries, side by side: every retried request was lost to the second."""
    phases = [Phase("baseline", 0.0, 4.0), Phase("router-restart", 4.0, 8.0)]
    results = [
        _r(1.0, 2.0, 10.0),  # ok to both
        Result(4.1, 6.0, 900.0, 100, 50, retries=4, sent=5.5),  # ok once retried
        Result(4.2, 6.5, 950.0, 100, 50, "ClientPayloadError: cut", retries=2, sent=5.6),
        _r(6.0, 6.5, None, "HTTP 503: no endpoint"),  # lost to both
    ]
    base, restart = by_phase(results, phases)
    assert (base["lost"], base["lost_without_retries"]) == (0, 0)
    assert (restart["ok"], restart["broken"], restart["lost"]) == (1, 1, 1)
    assert (restart["ok_without_retries"], restart["broken_without_retries"]) == (0, 0)
    assert restart["lost_without_retries"] == 3 and restart["retried"] == 2
    got = assemble(results, [], [], phases)["targets"]
    assert (got["lost_before_first_token"], got["lost_without_retries"]) == (1, 3)
    assert not got["lost_ok"] and not got["lost_without_retries_ok"]
    clean = assemble(results[:2], [], [], phases)["targets"]
    assert clean["lost_ok"] and clean["lost_without_retries"] == 1
    assert not clean["lost_without_retries_ok"]


def test_the_runs_ports_can_be_chosen(tmp_path: Path, capsys) -> None:
    import socket

    from kvmesh.bench.chaos_procs import Fleet, ports_needed
    from kvmesh.bench.fleet_procs.ports import port_block

    parser = argparse.ArgumentParser()
    chaos.add_args(parser)
    base = port_block(ports_needed(2))
    args = parser.parse_args(["--engines", "2", "--base-port", str(base), "--out", str(tmp_path)])
    fleet = Fleet(args, tmp_path, [])  # commands only: nothing starts
    assert fleet.urls == [f"http://127.0.0.1:{base + 4}", f"http://127.0.0.1:{base + 5}"]
    assert fleet.router_url == f"http://127.0.0.1:{base + 6}"
    assert f"tcp://*:{base + 3}" in " ".join(fleet.cmds[1])  # engine 1's replay socket
    with socket.create_server(("127.0.0.1", base + 5)):
        assert chaos.main(args) == 2  # refused before anything starts
    assert f"--base-port {base}..{base + 6}: taken: {base + 5}" in capsys.readouterr().out
    default = parser.parse_args(["--engines", "2"])
    assert default.base_port == 0  # free ports, chosen by the run
