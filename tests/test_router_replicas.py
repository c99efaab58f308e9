"""`kvmesh bench fleet --router-replicas`: kvmesh router replicas, active-active over the same
emulated engines behind a round-robin front, a row per replica count."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvmesh.bench import fleet, replicas


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    fleet.add_args(parser)
    return parser


def test_replica_counts_parse() -> None:
    assert replicas.parse_counts("1,2,4") == [1, 2, 4]
    assert replicas.parse_counts(" 4 , 1 ") == [4, 1]
    assert replicas.parse_counts("") == []
    for bad in ("0", "1,x", "2,", "-1", "1.5", "17", "1,2,2"):
        with pytest.raises(ValueError, match="--router-replicas"):
            replicas.parse_counts(bad)


@pytest.mark.parametrize("bad", ["0", "two", "1,,2", "2,2"])
def test_bad_router_replicas_is_refused_with_a_message(bad, tmp_path: Path, capsys) -> None:
    args = _parser().parse_args(["--quick", "--router-replicas", bad, "--out", str(tmp_path)])
    assert fleet.main(args) == 2
    said = capsys.readouterr().out
    assert "--router-replicas" in said and repr(bad) in said
    assert not (tmp_path / "fleet.json").exists()  # refused before any engine started


def test_targets_compare_each_count_with_one_replica() -> None:
    rows = {
        "kvmesh x1": {"replicas": 1, "hit_rate": 0.80},
        "kvmesh x2": {"replicas": 2, "hit_rate": 0.79},
        "kvmesh x4": {"replicas": 4, "hit_rate": 0.70},
        "round-robin": {"hit_rate": 0.5},
    }
    got = replicas.targets(rows)
    assert got["replicas_hit_rate_of_one"] == {"x2": 0.9875, "x4": 0.875}
    assert got["replicas_hit_rate_ok"] is False
    del rows["kvmesh x4"]
    assert replicas.targets(rows)["replicas_hit_rate_ok"] is True
    assert replicas.targets({"kvmesh x2": rows["kvmesh x2"]}) == {}  # no one-replica row


def test_replica_rows_count_every_request_once(tmp_path: Path) -> None:
    """A tiny agentic workload through 1 and 2 replicas: each replica answered its share (the
    shares sum to the requests sent, as the front counted them too), every replica's precise
    index was fed by the engines' events and agrees with the others' in size."""
    args = ["--quick", "--policies", "", "--router-replicas", "1,2", "--out", str(tmp_path)]
    assert fleet.main(_parser().parse_args(args)) == 0
    result = json.loads((tmp_path / "fleet.json").read_text())
    assert list(result["policies"]) == ["kvmesh x1", "kvmesh x2"]
    assert not [s for s in result["skipped"] if "replica" in s or "not reset" in s]
    sent = result["workload"]["requests"]
    for name, s in result["policies"].items():
        n = s["replicas"]
        assert name == f"kvmesh x{n}" and s["requests"] == sent and s["errors"] == 0
        assert len(s["replica_requests"]) == n and sum(s["replica_requests"]) == sent
        assert s["front_requests"] == s["replica_requests"]
        assert all(r > 0 for r in s["replica_requests"])  # round-robin reached every replica
        assert sum(s["load"].values()) == sent  # per engine, from the engine's header
        assert 0 < s["hit_rate"] <= 1 and s["engine_hit_rate"] is not None
        assert len(s["replica_predicted_hit_rate"]) == n
        assert all(e > 0 for e in s["replica_precise_entries"]) and s["precise_index_agree"]
    targets = result["targets"]
    assert set(targets["replicas_hit_rate_of_one"]) == {"x2"}
    assert isinstance(targets["replicas_hit_rate_ok"], bool)


async def test_balancer_front_takes_upstreams_in_turn_and_passes_headers_on() -> None:
    """The default front sends each request to the next replica with the client's headers
    (x-session-id reaches the replica), streams the answer back with the replica's headers
    (x-kvmesh-endpoint first, as the load client reads it) and counts per replica."""
    import aiohttp
    from aiohttp import web

    from kvmesh.bench import rr_front
    from kvmesh.bench.fleet_procs.ports import free_port

    async def upstream(name: str) -> tuple[web.AppRunner, str]:
        async def answer(request: web.Request) -> web.StreamResponse:
            out = web.StreamResponse(headers={"x-kvmesh-endpoint": f"engine-of-{name}"})
            await out.prepare(request)
            seen = request.headers.get("x-session-id", "-")
            await out.write(f"data: {name} {seen} {await request.text()}\n\n".encode())
            return out

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, f"http://127.0.0.1:{port}"

    ups = [await upstream(n) for n in ("a", "b")]
    front = web.AppRunner(rr_front.make_app([u for _, u in ups]))
    await front.setup()
    port = free_port()
    await web.TCPSite(front, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            got = []
            for i in range(4):
                headers = {"x-session-id": f"s{i}"}
                async with http.post(f"{url}/v1/completions", data="{}", headers=headers) as r:
                    assert r.status == 200
                    tags = r.headers.getall("x-kvmesh-endpoint")
                    got.append(((await r.text()).strip(), tags, r.headers["x-kvmesh-front"]))
            async with http.get(f"{url}/metrics") as r:
                page = await r.text()
        assert [g[0] for g in got] == ["data: a s0 {}", "data: b s1 {}", "data: a s2 {}",
                                       "data: b s3 {}"]  # fmt: skip
        assert got[1][1] == ["engine-of-b"] and got[1][2] == ups[1][1]
        assert f'endpoint="{ups[0][1]}",outcome="ok"}} 2' in page
    finally:
        await front.cleanup()
        for runner, _ in ups:
            await runner.cleanup()


def test_a_kvmesh_round_robin_router_can_front_the_replicas(tmp_path: Path) -> None:
    """--replica-front router: a `kvmesh router --preset round-robin` over the replicas."""
    args = ["--quick", "--policies", "", "--router-replicas", "2", "--replica-front", "router",
            "--out", str(tmp_path)]  # fmt: skip
    assert fleet.main(_parser().parse_args(args)) == 0
    result = json.loads((tmp_path / "fleet.json").read_text())
    s, sent = result["policies"]["kvmesh x2"], result["workload"]["requests"]
    assert s["front"] == replicas.FRONTS["router"] and s["errors"] == 0
    assert sum(s["replica_requests"]) == sent and s["front_requests"] == s["replica_requests"]
    assert sum(s["load"].values()) == sent  # the engine's x-kvmesh-endpoint comes first
    assert "replicas_hit_rate_ok" not in result["targets"]  # no one-replica row to compare
