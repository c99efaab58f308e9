"""`kvmesh up` restarts a child (engine or router process) that exits once the stack is ready,
after a back-off that doubles to its cap and starts over once a child stayed healthy; the
other child keeps running; a crash loop ends `up` with the child's code. Stand-in children;
back-offs of hundredths of a second; every wait is on a condition."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvmesh.cli import main
from kvmesh.commands.up_supervisor import RestartPolicy
from tests.test_up_supervisor import READY_MARK, SLEEP, Recorded, children_gone, run_with

FAST = ("--restart-initial-delay", "0.01", "--restart-max-delay", "0.04")


def killed_once_ready(runs: Path, after: str) -> str:
    """A child that counts its runs in ``runs``: the first waits for `up` to say ready and
    is killed by SIGKILL, as `kill -9` would; the runs after it run ``after``."""
    return (
        "import os, signal, sys, time\n"
        f"with open({str(runs)!r}, 'a') as f: f.write('x')\n"
        f"if os.path.getsize({str(runs)!r}) == 1:\n"
        f"    while not os.path.exists({READY_MARK!r}): time.sleep(0.02)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n" + after
    )


def stop_once_said(prefix: str, deadline_s: float = 60.0) -> threading.Thread:
    """Has `up` stop (as SIGTERM would) once it said a line starting with prefix."""

    def watch() -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            stack = Recorded.last
            if stack is not None and any(line.startswith(prefix) for line in stack.lines):
                break
            time.sleep(0.02)
        if Recorded.last is not None:
            Recorded.last.signalled = True

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("crashing", ["engine", "router"])
def test_a_killed_child_is_restarted_and_the_other_keeps_running(
    monkeypatch, capsys, tmp_path, crashing
):
    crash = killed_once_ready(tmp_path / "runs", SLEEP)
    engine, router = (crash, SLEEP) if crashing == "engine" else (SLEEP, crash)
    back = f"kvmesh up: the {crashing} answers /health again"
    watcher = stop_once_said(back)
    assert run_with(monkeypatch, engine, router, flags=FAST) == 0
    watcher.join()
    lines = Recorded.last.lines
    said = f"kvmesh up: the {crashing} was killed by SIGKILL; restart 1 in 0.01 s"
    assert said in lines
    assert any(line.startswith(back) for line in lines)
    assert (tmp_path / "runs").read_text() == "xx"  # started again once
    assert Recorded.last.restarts() == {"engine": 0, "router": 0, crashing: 1}
    assert children_gone() == {"engine": -signal.SIGTERM, "router": -signal.SIGTERM}
    err = capsys.readouterr().err
    assert said in err and "kvmesh up: restarts while up: engine" in err


def test_back_off_doubles_to_its_cap_and_a_crash_loop_ends_up(monkeypatch, capsys, tmp_path):
    crash = killed_once_ready(tmp_path / "runs", "sys.exit(3)")
    flags = (*FAST, "--crash-loop-restarts", "3", "--crash-loop-window", "600")
    assert run_with(monkeypatch, crash, SLEEP, flags=flags) == 3
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("kvmesh up: the engine")]
    assert said == [
        "kvmesh up: the engine was killed by SIGKILL; restart 1 in 0.01 s",
        "kvmesh up: the engine exited with code 3; restart 2 in 0.02 s",
        "kvmesh up: the engine exited with code 3; restart 3 in 0.04 s",
        "kvmesh up: the engine exited with code 3, its exit 4 within 600 s: a crash loop; "
        "stopping (its log above says why)",
    ]
    assert (tmp_path / "runs").read_text() == "xxxx"
    assert children_gone() == {"engine": 3, "router": -signal.SIGTERM}


def test_the_back_off_starts_over_after_a_healthy_spell():
    policy = RestartPolicy(restart_initial_delay=1.0, restart_max_delay=30.0)
    delays, delay = [], 0.0
    for _ in range(7):
        delay = policy.next_delay(delay, healthy_for=5.0)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert policy.next_delay(30.0, healthy_for=policy.restart_reset_after) == 1.0


def test_bad_restart_flags_are_refused_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr("kvmesh.commands.up.Stack", None)  # would fail at once if reached
    assert main(["up", "--restart-initial-delay", "0"]) == 2
    assert "--restart-initial-delay" in capsys.readouterr().err
    assert main(["up", "--crash-loop-restarts", "-1"]) == 2


def _get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _replays(base: str, engine: str) -> float:
    """KV event replays the router applied from the engine's replay socket, all reasons."""
    page = _get(base + "/metrics")[1].decode()
    mark = f'kvmesh_router_kv_event_replays_total{{endpoint="{engine}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(mark))


def _eventually(check, what: str, deadline_s: float = 60.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"never: {what}")


@pytest.mark.slow  # about 20 s on a small host: three interpreters load the tokenizer
def test_kvmesh_up_restarts_a_killed_engine_and_its_router_takes_it_back(tmp_path):
    from kvmesh.commands import up

    port = up.free_run(3)
    cmd = [sys.executable, "-m", "kvmesh.cli", "up", "--emulate", "2", "--port", str(port)]
    err = open(tmp_path / "err", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [*cmd, "--restart-initial-delay", "0.05"],
        stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        _eventually(lambda: any(x.startswith("kvmesh ready") for x in lines), "ready")
        children = {
            int(p): Path(f"/proc/{int(p)}/cmdline").read_bytes()
            for p in subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()
        }
        engine = next(p for p, c in children.items() if b"\0serve\0" in c)
        router = next(p for p, c in children.items() if b"\0router\0" in c)
        ask = {"prompt": "a story " * 40, "max_tokens": 4}
        assert _get(base + "/v1/completions", ask)[0] == 200
        engines = [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
        replayed = [_replays(base, url) for url in engines]
        assert all(replayed)  # followed from the start
        os.kill(engine, signal.SIGKILL)
        _eventually(lambda: any("engines answer /health again" in x for x in lines), "restart")
        _eventually(lambda: _get(base + "/v1/completions", ask)[0] == 200, "served again")
        back = 'kvmesh_router_endpoint_readmissions_total{endpoint="%s",reason="reachable"}'
        warm = 'kvmesh_router_kv_index_warm{endpoint="%s"} 1.0'
        # each engine seen gone and back; a restarted publisher's events followed again
        wanted = [back % url for url in engines] + [warm % url for url in engines]
        _eventually(
            lambda: all(w in _get(base + "/metrics")[1].decode() for w in wanted),
            "the router takes the engines back",
        )
        _eventually(
            lambda: (
                _get(base + "/v1/completions", {**ask, "prompt": f"{time.time()} " * 40})
                and sum(_replays(base, u) for u in engines) > sum(replayed)
            ),
            "KV events of a restarted engine",
        )
        os.kill(router, 0)  # the router was never stopped
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log = (tmp_path / "err").read_text()
        assert "kvmesh up: the engine was killed by SIGKILL; restart 1 in 0.05 s" in log
        assert "restarts while up: engine 1, router 0" in log
        assert "Traceback" not in log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        err.close()
