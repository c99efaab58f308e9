"""`kvmesh bench router --quick` end to end (emulated engines and the kvmesh router as
subprocesses), and the lean HTTP client's response parser."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from kvmesh.bench.router_bench import add_args, main
from kvmesh.bench.router_client import Response
from kvmesh.bench.router_rounds import median_rows


def _feed_split(raw: bytes, step: int) -> Response:
    resp = Response()
    for i in range(0, len(raw), step):
        assert not resp.done
        resp.feed(raw[i : i + step])
    return resp


def test_response_parser_content_length_and_chunked() -> None:
    plain = b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\nContent-Type: x\r\n\r\n{"a":1}'
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\ndata:\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"
    )
    for raw in (plain, chunked):
        for step in (1, 3, 7, len(raw)):
            resp = _feed_split(raw, step)
            assert resp.done and resp.status == 200 and resp.body_seen, (raw, step)
    partial = Response()
    partial.feed(chunked[:-2])
    assert not partial.done
    head = Response()
    head.feed(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    assert head.done and head.status == 503 and head.close and not head.body_seen


def test_help_explains_what_is_measured() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    text = parser.format_help()
    for word in ("--sglang-router-bin", "--vllm-router-bin", "--quick", "CPU us/req", "p99"):
        assert word in text


def test_quick_run_reports_latency_rate_and_cpu_over_http_only(tmp_path: Path, capsys) -> None:
    """The in-process micro-benchmarks are scripts under benchmarks/: the command points at
    them and reports only what it measured over HTTP."""
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert main(parser.parse_args(["--quick", "--rounds", "2", "--out", str(tmp_path)])) == 0
    assert "benchmarks/router_scheduling.py" in capsys.readouterr().out
    result = json.loads((tmp_path / "router.json").read_text())
    assert (tmp_path / "router.png").stat().st_size > 0
    assert {"config", "pinning", "skipped", "fleets", "targets"} <= set(result)
    assert not {"micro", "path"} & set(result)
    (fleet,) = result["fleets"]
    assert fleet["engines"] == 2 and not fleet["failed"]
    assert fleet["direct"]["throughput"]["req_s"] > 0
    (row,) = fleet["routers"]
    assert row["router"] == "kvmesh kvmesh"
    cases = {"small", "8k", "small_stream_ttfb", "8k_stream_ttfb"}
    assert set(row["latency"]) == cases == set(fleet["direct"]["latency"])
    for case, lat in row["latency"].items():
        assert lat["errors"] == 0 and lat["n"] > 0, case
        for key in ("p50_ms", "p99_ms", "direct_p50_ms", "direct_p99_ms"):
            assert lat[key] > 0, (case, key)
        assert math.isfinite(lat["added_p50_ms"]) and math.isfinite(lat["added_p99_ms"])
    tp = row["throughput"]
    assert tp["req_s"] > 0 and tp["errors"] == 0
    for loop in ("throughput_8k", "throughput_repeated"):  # 8k new prompts; the extra case
        assert row[loop]["req_s"] > 0 and row[loop]["router_cpu_us_per_req"] > 0
        assert fleet["direct"][loop]["req_s"] > 0
    assert len(row["rounds"]) == 2  # each figure: the median of the rounds'
    both = [r["throughput"]["router_cpu_us_per_req"] for r in row["rounds"]]
    assert tp["router_cpu_us_per_req"] == round(statistics.median(both), 4)
    assert tp["router_cpu_us_per_req"] > 0 and tp["engines_cpu_us_per_req"] > 0
    assert "kvmesh_added_p50_ms" in result["targets"]["engines_2"]["small"]
    for key in ("router_cpu_us_per_req", "router_cpu_us_per_req_8k", "req_s_repeated"):
        assert result["targets"]["engines_2"][key]["kvmesh"] > 0


def test_interleaved_run_sends_each_request_through_every_router(tmp_path: Path) -> None:
    """--interleave: both routers run at once and share the direct samples of each request,
    so their added latencies come from the same moments of the host."""
    parser = argparse.ArgumentParser()
    add_args(parser)
    argv = ["--interleave", "--no-micro", "--engines", "2", "--requests", "10", "--duration", "0.5"]
    argv += ["--warmup", "0.2", "--routers", "kvmesh:kvmesh,kvmesh:random"]
    assert main(parser.parse_args([*argv, "--out", str(tmp_path)])) == 0
    (fleet,) = json.loads((tmp_path / "router.json").read_text())["fleets"]
    assert not fleet["failed"]
    rows = {r["router"]: r for r in fleet["routers"]}
    assert set(rows) == {"kvmesh kvmesh", "kvmesh random"}
    for case in ("small", "8k", "small_stream_ttfb", "8k_stream_ttfb"):
        a, b = (rows[k]["latency"][case] for k in sorted(rows))
        assert a["n"] == b["n"] == 10 and a["errors"] == b["errors"] == 0
        assert (
            a["direct_p50_ms"] == b["direct_p50_ms"] == fleet["direct"]["latency"][case]["p50_ms"]
        )
        for lat in (a, b):
            assert lat["added_p50_ms"] == round(lat["p50_ms"] - lat["direct_p50_ms"], 4)
    for row in rows.values():
        assert row["throughput"]["req_s"] > 0 and row["throughput"]["router_cpu_us_per_req"] > 0


def test_rounds_combine_as_the_median_of_each_figure() -> None:
    rows = [
        {"latency": {"small": {"added_p50_ms": v, "n": 30}}, "throughput": {"req_s": 10 * v}}
        for v in (0.3, 0.1, 0.2)
    ] + [{"latency": {"small": {"added_p50_ms": 9.0, "n": 30}}, "throughput": {"req_s": 1.0}}]
    rows[0]["throughput"]["note"] = "kept from the first"
    out = median_rows(rows)
    assert out["latency"]["small"] == {"added_p50_ms": 0.25, "n": 30}
    assert out["throughput"] == {"req_s": 1.5, "note": "kept from the first"}


def test_envoy_with_the_kvmesh_picker_is_a_router_row_not_a_peer(tmp_path) -> None:
    """`envoy:PRESET` runs Envoy in front of the engines with kvmesh as its ext_proc picker; it
    is reported beside kvmesh's own proxy and never counted as the best peer."""
    from kvmesh.bench.envoy_epp import envoy_config
    from kvmesh.bench.fleet_procs.routers import Target, router_command
    from kvmesh.bench.router_bench import _targets
    from kvmesh.bench.router_report import _peers

    (t,) = _targets("envoy:kvmesh")
    assert t == Target("envoy", "kvmesh") and t.label == "envoy + kvmesh EPP kvmesh"
    cmd = router_command(t, ["http://a:1", "http://b:2"], 8080, {"envoy": "/x/envoy"})
    assert cmd[1:3] == ["-m", "kvmesh.bench.envoy_epp"] and "--endpoint=http://b:2" in cmd
    fleet = {"routers": [{"kind": "envoy"}, {"kind": "kvmesh"}, {"kind": "vllm"}]}
    assert _peers(fleet) == [{"kind": "vllm"}]
    config = envoy_config(8080, 9002)
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["port_value"] == 8080
    epp = [c for c in config["static_resources"]["clusters"] if c["name"] == "kvmesh_epp"][0]
    address = epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["port_value"] == 9002


def test_the_closed_loop_sends_a_new_prompt_on_every_request_unless_told_to_repeat() -> None:
    from kvmesh.bench.router_client import prompt_requests

    def prompt(raw: bytes) -> str:
        return json.loads(raw.split(b"\r\n\r\n", 1)[1])["prompt"]

    new = prompt_requests("http://127.0.0.1:1", "m", "shared context")
    sent = [prompt(new(k, i)) for k in range(8) for i in range(100)]
    assert len(set(sent)) == len(sent)  # as traffic is: never the same prompt twice
    assert all(p.startswith("shared context #") for p in sent)  # a prefix they all share
    repeated = prompt_requests("http://127.0.0.1:1", "m", "shared context", repeated=64)
    sent = [prompt(repeated(k, i)) for k in range(8) for i in range(100)]
    assert len(set(sent)) == 64


def test_another_checkouts_kvmesh_is_a_router_row_of_its_own(tmp_path) -> None:
    """`kvmesh@SRC:PRESET` runs the kvmesh of another checkout (its src directory first on the
    path), so two versions are measured in one run; anything else after @ is refused."""
    import pytest

    from kvmesh.bench.fleet_procs.routers import router_command
    from kvmesh.bench.router_bench import _targets

    (tmp_path / "kvmesh").mkdir()
    (t,) = _targets(f"kvmesh@{tmp_path}:kvmesh")
    assert t.src == str(tmp_path) and t.label == f"kvmesh kvmesh ({tmp_path})"
    cmd = router_command(t, ["http://a:1"], 8080, {})
    assert (
        cmd[:2] == ["env", f"PYTHONPATH={tmp_path}"] and cmd[cmd.index("--preset") + 1] == "kvmesh"
    )
    for bad in (f"kvmesh@{tmp_path / 'none'}:kvmesh", f"vllm@{tmp_path}:round_robin"):
        with pytest.raises(SystemExit, match="kvmesh@SRC"):
            _targets(bad)
