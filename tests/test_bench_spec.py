"""`kvmesh bench spec`: per-user arithmetic, acceptance from counters, the greedy check, the
workloads' determinism, the chat stream client on a fake server, and a tiny real run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from rich.console import Console

from kvmesh.bench import http_load, spec_bench, spec_report, spec_workloads
from kvmesh.bench.fleet_procs.ports import free_port
from kvmesh.bench.spec_report import ChatResult

ROOT = Path(__file__).resolve().parents[1]


def test_user_rates_count_tokens_not_chunks():
    # 9 tokens after the first over 0.9 s: 100 ms per token, 10 tok/s, however many chunks
    itl, tok_s = spec_report.user_rates(first=0.5, last=1.4, tokens=10)
    assert itl == pytest.approx(0.1) and tok_s == pytest.approx(10.0)
    assert spec_report.user_rates(0.5, 0.5, 4) == (None, None)  # all in one chunk
    assert spec_report.user_rates(0.5, 0.9, 1) == (None, None)


def test_summarize_medians_and_tokens_per_chunk():
    results = [
        ChatResult(0, tokens=11, first=0.2, last=1.2, chunks=5, text="a"),
        ChatResult(1, tokens=21, first=0.4, last=1.4, chunks=7, text="b"),
        ChatResult(2, tokens=1, first=0.3, last=0.3, chunks=1, text="c"),
    ]
    s = spec_report.summarize(results)
    assert s["tok_s_user_p50"] == 15.0  # median of 10 and 20; the 1-token request has none
    assert s["itl_ms_p50"] == 75.0 and s["ttft_ms_p50"] == 300.0
    assert s["tokens_per_chunk"] == round(33 / 13, 2) and s["output_tokens"] == 33
    assert [r["text"] for r in s["per_request"]] == ["a", "b", "c"]


PAGE = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {d}
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {t}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.7e9
"""


def test_acceptance_from_counter_growth():
    before = spec_report.spec_counters(PAGE.format(d=5, t=10, a=4, p0=3, p1=1))
    after = spec_report.spec_counters(PAGE.format(d=15, t=30, a=19, p0=12, p1=7))
    acc = spec_report.acceptance(before, after)
    assert (acc["drafts"], acc["draft_tokens"], acc["accepted_tokens"]) == (10, 20, 15)
    assert acc["acceptance_rate"] == 0.75 and acc["mean_acceptance_length"] == 2.5
    assert acc["per_position_rate"] == [0.9, 0.6]
    empty = spec_report.spec_counters("")
    assert spec_report.acceptance(empty, empty)["acceptance_rate"] is None


def _arm(texts: list[str]) -> dict:
    per = [{"index": i, "text": t, "tokens": len(t)} for i, t in enumerate(texts)]
    run = {"per_request": per, "tok_s_user_p50": 10.0, "itl_ms_p50": 100.0, "ttft_ms_p50": 1.0}
    run |= {"tokens_per_chunk": 1.0, "acceptance": {}}
    return {"status": "ok", "runs": {"edit": {"1": run}}}


def test_greedy_check_and_rows():
    arms = {"off": _arm(["abc", "xyz"]), "ngram": _arm(["abc", "xyq"])}
    arms["mtp"] = {"status": "failed", "reason": "no head"}
    g = spec_report.greedy_check(arms)
    assert g["checked"] == 2 and not g["ok"]
    assert g["mismatches"] == [
        {"arm": "ngram", "workload": "edit", "batch": 1, "index": 1, "first_diff_char": 2}
        | {"tokens": 3, "off_tokens": 3, "off": "xyz", "spec": "xyq"}
    ]
    rows = spec_report.rows(arms)
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert rows[1]["ratio_vs_off"] == 1.0 and rows[2]["reason"] == "no head"
    assert spec_report.targets(rows)[0]["met"] is False  # edit needs 2x


def test_workloads_are_deterministic_and_sized():
    for name, (_, text) in spec_workloads.FILES.items():
        assert 40 <= len(text.splitlines()) <= 120, name
    a, b = spec_workloads.requests("edit", 8), spec_workloads.requests("edit", 8)
    assert a == b and len({r.messages for r in a}) == 8
    assert all(spec_workloads.FILES[r.label.split(":")[0]][1] in r.messages[1][1] for r in a)
    chat = spec_workloads.requests("chat", 14)
    assert chat[12].messages == chat[0].messages and chat[0].chat_messages()[0]["role"] == "user"
    with pytest.raises(ValueError):
        spec_workloads.requests("nope", 1)


def test_plan_flags():
    parser = argparse.ArgumentParser()
    spec_bench.add_args(parser)
    plan = spec_bench.make_plan(parser.parse_args([]))
    assert plan.batch_sizes == [1, 8] and plan.requests == 8
    assert plan.max_tokens == {"edit": 256, "chat": 128} and plan.arms == ["off", "ngram", "mtp"]
    quick = spec_bench.make_plan(parser.parse_args(["--quick", "--max-tokens-chat", "4"]))
    assert quick.batch_sizes == [1, 2] and quick.max_tokens == {"edit": 32, "chat": 4}
    with pytest.raises(ValueError):
        spec_bench.make_plan(parser.parse_args(["--arms", "off,medusa"]))


def test_emulated_branch_reports_a_missing_module(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "kvmesh.bench.spec_emulated", None)
    console = Console(record=True, width=200)
    assert spec_bench.run_emulated(console, tmp_path, True) == 2
    assert "spec_emulated is not in" in console.export_text()


async def test_stream_chat_times_text_chunks_only():
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["temperature"] == 0 and body["stream"] and body["max_tokens"] == 5
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        deltas = [{"role": "assistant", "content": ""}, {"content": "ab"}, {"content": "cde"}]
        for i, delta in enumerate(deltas):
            fin = "length" if i == len(deltas) - 1 else None
            chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": fin}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": 5}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        req = spec_workloads.requests("chat", 1)[0]
        async with http_load.session() as http:
            res = await spec_bench.stream_chat(http, f"http://127.0.0.1:{port}", "m", req, 5)
    finally:
        await runner.cleanup()
    assert res.error == "" and res.text == "abcde" and res.chunks == 2 and res.tokens == 5
    assert res.finish_reason == "length" and 0 < res.first <= res.last


def test_quick_run_off_and_ngram(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvmesh.cli", "bench", "spec", "--quick", "--out", str(out)]
    cmd += ["--arms", "off,ngram", "--batch-sizes", "1", "--requests", "1"]
    cmd += ["--max-tokens-edit", "8", "--max-tokens-chat", "8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tok/s/user" in proc.stdout and "greedy outputs identical" in proc.stdout
    results = json.loads((out / "spec.json").read_text())
    assert (out / "spec.png").stat().st_size > 1000
    assert results["greedy_match"] == {"checked": 2, "mismatches": [], "ok": True}
    for arm in ("off", "ngram"):
        assert results["arms"][arm]["status"] == "ok"
        for wl in ("edit", "chat"):
            run = results["arms"][arm]["runs"][wl]["1"]
            assert run["requests"] == 1 and 1 <= run["output_tokens"] <= 8
            assert run["ttft_ms_p50"] > 0
    assert results["arms"]["ngram"]["runs"]["edit"]["1"]["acceptance"]["drafts"] >= 0
    assert results["arms"]["off"]["runs"]["edit"]["1"]["acceptance"]["drafts"] == 0
    assert {(r["arm"], r["workload"]) for r in results["rows"]} == {
        (a, w) for a in ("off", "ngram") for w in ("edit", "chat")
    }
