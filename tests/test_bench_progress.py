"""Benches that save as they go: the shared BenchRun writer and LineProgress, and a real
`kvmesh bench ep` interrupted with SIGINT after its first row, which leaves a valid partial file."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.bench.progress import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    BenchRun,
    LineProgress,
    write_json_atomic,
)


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_rows_are_saved_whole_after_each_add(tmp_path):
    err = io.StringIO()
    seen: list[dict] = []

    def body(run: BenchRun) -> int:
        for i in range(3):
            run.add({"i": i, "tok_s": 10.0 * i}, f"row {i}")
            seen.append(_load(run.path))
        return 0

    run = BenchRun("demo", tmp_path / "out", total=3, config={"n": 3}, stream=err)
    assert run.call(body) == 0
    assert [d["rows_done"] for d in seen] == [1, 2, 3]
    assert all(d["status"] == "running" and not d["interrupted"] for d in seen)
    assert seen[1]["rows"] == [{"i": 0, "tok_s": 0.0}, {"i": 1, "tok_s": 10.0}]
    doc = _load(tmp_path / "out" / "demo.rows.json")
    assert doc["status"] == "complete" and doc["exit_code"] == 0
    assert doc["rows_total"] == 3 and doc["config"] == {"n": 3}
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["demo.rows.json"]  # no temp left
    assert "row 2/3 saved: row 1" in err.getvalue()


def test_ctrl_c_marks_the_run_interrupted_and_keeps_its_rows(tmp_path):
    def body(run: BenchRun) -> int:
        run.add({"i": 0})
        raise KeyboardInterrupt

    err = io.StringIO()
    run = BenchRun("demo", tmp_path, total=4, stream=err)
    assert run.call(body) == EXIT_INTERRUPTED
    doc = _load(run.path)
    assert doc["status"] == "interrupted" and doc["interrupted"] is True
    assert doc["rows"] == [{"i": 0}] and doc["rows_done"] == 1 and doc["rows_total"] == 4
    assert "interrupted by SIGINT (Ctrl-C): 1 row saved" in err.getvalue()


def test_sigterm_unwinds_like_ctrl_c_and_restores_the_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)

    def body(run: BenchRun) -> int:
        run.add({"i": 0})
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes of this thread
            time.sleep(0.01)
        return 0

    run = BenchRun("demo", tmp_path, stream=io.StringIO())
    assert run.call(body) == EXIT_TERMINATED
    assert _load(run.path)["status"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_failing_bench_saves_its_rows_and_raises(tmp_path):
    def body(run: BenchRun) -> int:
        run.add({"i": 0})
        raise RuntimeError("engine died")

    run = BenchRun("demo", tmp_path, stream=io.StringIO())
    with pytest.raises(RuntimeError):
        run.call(body)
    doc = _load(run.path)
    assert doc["status"] == "failed" and doc["error"] == "RuntimeError: engine died"
    assert doc["rows"] == [{"i": 0}]


def test_quiet_rows_are_saved_in_batches_and_all_at_the_end(tmp_path):
    def body(run: BenchRun) -> int:
        run.add({"rid": 0}, quiet=True)  # within QUIET_SAVE_S of the start's save: held
        assert _load(run.path)["rows"] == []
        for rid in range(1, 50):
            run.add({"rid": rid}, quiet=True)
        return 0

    err = io.StringIO()
    run = BenchRun("trace", tmp_path, total=50, stream=err)
    assert run.call(body) == 0
    doc = _load(run.path)
    assert doc["rows_done"] == 50 and [r["rid"] for r in doc["rows"]] == list(range(50))
    assert "row 1/50 saved" not in err.getvalue()  # quiet rows: no line each


def test_every_bench_command_saves_through_bench_run():
    """Each `kvmesh bench X` main hands its body to BenchRun (rows saved as they finish)."""
    import importlib
    import inspect

    from kvmesh.bench import workload_cmd
    from kvmesh.cli import BENCH_COMMANDS

    mains = [importlib.import_module(m).main for m, _ in BENCH_COMMANDS.values()]
    for main in [*mains, workload_cmd.main_workload]:
        assert "BenchRun(" in inspect.getsource(main), main.__module__


def test_atomic_write_replaces_the_file_in_one_step(tmp_path):
    path = tmp_path / "x.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "p": Path("/p")})  # paths and the like as strings
    assert _load(path) == {"a": 2, "p": "/p"}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_line_progress_prints_start_throttled_updates_and_end():
    now = [0.0]
    err = io.StringIO()
    p = LineProgress("demo", stream=err, every_s=10.0, heartbeat_s=0, clock=lambda: now[0])
    with p:
        task = p.add_task("kvmesh: batch 8", total=4)
        p.advance(task)  # within every_s of the last line: silent
        now[0] = 12.0
        p.advance(task)  # past it: one line
        for _ in range(2):
            p.advance(task)
        p.advance(task)  # finished tasks stay quiet
    lines = err.getvalue().splitlines()
    assert lines == [
        "[bench demo 0:00] kvmesh: batch 8 ... 0/4",
        "[bench demo 0:12] kvmesh: batch 8  2/4 (50%)",
        "[bench demo 0:12] kvmesh: batch 8  done 4/4 in 12.0 s",
    ]


def test_a_silent_task_gets_a_heartbeat_line():
    now = [0.0]
    err = io.StringIO()
    p = LineProgress("demo", stream=err, every_s=10.0, heartbeat_s=0.03, clock=lambda: now[0])
    with p:
        p.add_task("starting kvmesh engine", total=None)
        now[0] = 45.0
        deadline = time.monotonic() + 30
        while "still running" not in err.getvalue():
            assert time.monotonic() < deadline, err.getvalue()
            time.sleep(0.01)
    assert "[bench demo 0:45] starting kvmesh engine  still running (0:45)" in err.getvalue()


def _wait_for_rows(path: Path, proc: subprocess.Popen, deadline_s: float) -> dict:
    """The rows file once it holds a row; fails if the bench exits or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.exists():
            doc = _load(path)  # whole by construction: written by os.replace
            if doc["rows"]:
                return doc
        assert proc.poll() is None, "the bench ended before its first row was saved"
        time.sleep(0.05)
    pytest.fail(f"no row in {path} within {deadline_s} s")


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_real_bench_interrupted_after_its_first_row_leaves_a_partial_result(tmp_path):
    # C=1 takes a moment; C=4096 with these steps takes far longer, so SIGINT lands in row 2.
    cmd = [sys.executable, "-m", "kvmesh.cli", "bench", "ep", "--layouts", "dp8"]
    cmd += ["--concurrency", "1,4096", "--max-num-seqs", "1024", "--input-len", "128"]
    cmd += ["--output-len", "32", "--warmup-steps", "5", "--steps", "600"]
    cmd += ["--out", str(tmp_path)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,  # a background job's shell hands down SIGINT ignored
    )
    try:
        first = _wait_for_rows(tmp_path / "ep.rows.json", proc, deadline_s=240)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert first["status"] == "running" and first["rows"][0]["concurrency"] == 1
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    doc = _load(tmp_path / "ep.rows.json")
    assert doc["status"] == "interrupted" and doc["interrupted"] is True
    assert doc["rows_done"] == 1 and doc["rows_total"] == 2
    row = doc["rows"][0]
    assert row["layout"] == "DP8/EP8" and row["output_tok_s_per_gpu"] > 0
    assert not (tmp_path / "ep.json").exists()  # the final output is only for a whole run
    assert "Traceback" not in err
    assert "[bench ep " in err and "row 1/2 saved: DP8/EP8 C=1" in err
    assert "DP8/EP8 C=4096: steps ..." in err and "interrupted by SIGINT" in err
