"""`kvmesh bench chaos --hostile`: the soak's report on canned records (no processes), the
hostile client's requests and outcomes against a local socket server, and (slow) a tiny soak
end to end on two emulated engines."""

from __future__ import annotations

import argparse
import asyncio
import json
from itertools import islice
from pathlib import Path

import pytest
from rich.console import Console

from kvmesh.bench import chaos, chaos_hostile
from kvmesh.bench import chaos_hostile_report as rep
from kvmesh.bench.chaos_hostile import CLASSES, HostileRecord, build_requests, schedule
from kvmesh.bench.chaos_report import Result
from kvmesh.cli import build_parser


def _ok(ttft: float) -> Result:
    return Result(0.0, 1.0, ttft)


def _h(cls: str, status: int | None, end: str = "answer", variant: str = "v", s: float = 0.1):
    return HostileRecord(cls, variant, 0.0, s, status, end)


def test_help_names_the_soak(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "chaos", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("--hostile", "--hostile-rate", "--soak-seconds", "hostile.json", "20%"):
        assert phrase in text


def test_normal_rows_and_the_p99_ratio() -> None:
    clean = rep.normal_row("clean", [_ok(float(t)) for t in range(1, 101)])
    assert (clean["requests"], clean["failed"]) == (100, 0)
    assert (clean["ttft_ms_p50"], clean["ttft_ms_p99"]) == (50.5, 99.0)
    loaded = rep.normal_row("hostile", [_ok(float(t) * 1.1) for t in range(1, 101)])
    got = rep.p99_ratio(clean, loaded)
    assert got == {"p99_ratio": 1.1, "p99_ok": True, "no_ratio": ""}
    slow = rep.normal_row("hostile", [_ok(float(t) * 1.3) for t in range(1, 101)])
    assert (
        rep.p99_ratio(clean, slow)["p99_ratio"] == 1.3 and not rep.p99_ratio(clean, slow)["p99_ok"]
    )


def test_failures_come_before_any_ratio() -> None:
    clean = rep.normal_row("clean", [_ok(10.0)] * 50)
    results = [_ok(5.0)] * 48 + [
        Result(0.0, 1.0, None, error="HTTP 503: No healthy endpoint"),  # lost
        Result(0.0, 1.0, 4.0, error="ClientPayloadError: cut"),  # broken after its token
    ]
    loaded = rep.normal_row("hostile", results)
    assert loaded["failed"] == 2 and loaded["errors"][0].startswith("ClientPayloadError")
    got = rep.p99_ratio(clean, loaded)  # faster, but no ratio from a run with failures
    assert got["p99_ratio"] is None and not got["p99_ok"] and "2 normal" in got["no_ratio"]
    tg = rep.targets(clean, loaded, rep.class_rows([_h("fan-out", 400)]))
    assert tg["normal_failed"] == 2 and not tg["normal_failed_ok"] and tg["hostile_ok"]
    console = Console(width=200, record=True)
    console.print(rep.normal_table(clean, loaded, tg, "t"))
    assert "none: 2 normal requests failed" in console.export_text()


def test_hostile_verdicts_and_class_rows() -> None:
    assert rep.verdict(_h("c", 400)) == "refused" and rep.verdict(_h("c", 408)) == "refused"
    assert rep.verdict(_h("c", None, "close")) == "closed"
    assert rep.verdict(_h("c", 505, variant="HTTP/2.0 request line")) == "refused"  # RFC 9110
    assert rep.verdict(_h("c", 505)) == "5xx" and rep.verdict(_h("c", 500)) == "5xx"
    assert rep.verdict(_h("c", 200)) == "accepted"
    assert rep.verdict(_h("c", None, "timeout")) == "timeout"
    assert rep.verdict(_h("c", None, "connect: ConnectionRefusedError")) == "connect"
    records = [
        _h("slowloris", 408, s=30.0),
        _h("slowloris", None, "close", s=30.5),
        _h("oversized-prompt", 400, variant="a"),
        _h("oversized-prompt", None, "timeout", variant="b", s=10.0),
        _h("oversized-prompt", 503, variant="a"),
    ]
    records[2].leaked = True
    rows = {r["class"]: r for r in rep.class_rows(records)}
    assert list(rows) == ["slowloris", "oversized-prompt"]  # in order of first send
    slow, big = rows["slowloris"], rows["oversized-prompt"]
    assert (slow["sent"], slow["statuses"], slow["max_s"], slow["bad"]) == (
        2,
        {"408": 1, "close": 1},
        30.5,
        0,
    )
    assert (big["sent"], big["variants"], big["bad"], big["leaked"]) == (3, 2, 2, 1)
    assert big["statuses"] == {"400": 1, "503": 1, "timeout": 1}
    assert big["bad_examples"] == ["a: 503", "b: timeout"]
    clean = rep.normal_row("clean", [_ok(10.0)])
    tg = rep.targets(clean, rep.normal_row("hostile", [_ok(11.0)]), list(rows.values()))
    assert (tg["hostile_sent"], tg["hostile_bad"], tg["hostile_leaked"]) == (5, 2, 1)
    assert not tg["hostile_ok"] and tg["p99_ok"] and tg["normal_failed_ok"]
    console = Console(width=200, record=True)
    console.print(rep.hostile_table(list(rows.values())))
    text = console.export_text()
    assert "400 x1, 503 x1, timeout x1" in text and "1 quoted the key" in text


def test_every_class_is_built_and_sent_in_turn() -> None:
    requests = build_requests("m", mb=0.2)
    assert tuple(requests) == CLASSES
    sent = list(islice(schedule(requests, 0), 3 * len(CLASSES)))
    assert {c for c, _ in sent[: len(CLASSES)]} == set(CLASSES)  # each class once a round
    assert {v for c, v in sent if c == "request-id"} == set(list(requests["request-id"])[:3])
    head, _, body = requests["request-id"]["body id with CR LF"].partition(b"\r\n\r\n")
    assert json.loads(body)["request_id"] == "a\r\nX-Evil: 1"  # escaped in JSON, raw when read
    assert f"Content-Length: {len(body)}".encode() in head
    deep = requests["deep-json"]["nested 300 deep"].partition(b"\r\n\r\n")[2]
    assert deep.count(b"[") == 300 and json.loads(deep)["prompt"] == "hi"
    many = requests["many-messages"]["100,000 messages"].partition(b"\r\n\r\n")[2]
    assert len(json.loads(many)["messages"]) == 100_000
    assert chaos_hostile.partial("slowloris", "half a head")
    assert chaos_hostile.partial("malformed-http", "Content-Length beyond the body")
    assert not chaos_hostile.partial("malformed-http", "Content-Length: abc")


def test_the_hostile_client_records_what_came_back(monkeypatch) -> None:
    """Against a local server: an answer (its status, a quoted key), a close without an
    answer, and no answer within the timeout."""
    monkeypatch.setattr(chaos_hostile, "ANSWER_TIMEOUT_S", 0.5)
    key = chaos_hostile.SECRET.encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        if b"answer" in line:
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 30\r\n\r\n" + key)
        elif b"hang" in line:
            await asyncio.sleep(5)
        writer.close()

    async def main() -> list[HostileRecord]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return [
                await chaos_hostile.send("127.0.0.1", port, "c", v, f"GET /{v}\r\n".encode(), 0.0)
                for v in ("answer", "close", "hang")
            ]

    answer, closed, hung = asyncio.run(main())
    assert (answer.status, answer.end, answer.leaked) == (400, "answer", True)
    assert (closed.status, closed.end) == (None, "close")
    assert (hung.status, hung.end) == (None, "timeout")
    assert [rep.verdict(r) for r in (answer, closed, hung)] == ["refused", "closed", "timeout"]


@pytest.mark.slow  # about a minute: a fleet start, three short runs, slowloris' 30 s 408s
def test_a_tiny_hostile_soak(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    chaos.add_args(parser)
    argv = ["--quick", "--hostile", "--soak-seconds", "3", "--warmup-seconds", "1"]
    argv += ["--hostile-rate", "4", "--slowloris-connections", "2", "--out", str(tmp_path)]
    assert chaos.main(parser.parse_args(argv)) == 0
    result = json.loads((tmp_path / "hostile.json").read_text())
    clean, loaded = result["normal"]
    assert clean["requests"] > 0 and loaded["requests"] > 0
    tg = result["targets"]
    assert tg["normal_failed_ok"], result["normal"]
    assert tg["hostile_ok"], result["hostile_classes"]
    assert {c["class"] for c in result["hostile_classes"]} == set(CLASSES)
    assert tg["p99_ratio"] is not None  # reported; its size is the host's to judge
