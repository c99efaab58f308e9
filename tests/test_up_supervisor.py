"""`kvmesh up` supervises its engine and router processes: it forwards SIGTERM, kills a child
that outlives the grace period, stops the others and exits non-zero when a child dies (with
--no-restart-children; restarts: test_up_restarts), and leaves no process behind. The quick
tests run stand-in children; the slow one the real stack."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest

from kvmesh.cli import build_parser
from kvmesh.commands import up, up_supervisor
from kvmesh.commands.serve import _engine_config

SLEEP = "import time; time.sleep(60)"
# ignores SIGTERM, then sends one to `kvmesh up` (its parent) as a user would, once `up` has
# asked the engine its model name (just before it prints `kvmesh ready`: READY_MARK is written
# then), however slowly a busy host starts the children
READY_MARK = os.path.join(tempfile.mkdtemp(prefix="kvmesh-up-test-"), "ready")
IGNORES_SIGTERM = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    f"while not os.path.exists({READY_MARK!r}): time.sleep(0.02)\n"
    f"os.remove({READY_MARK!r}); os.kill(os.getppid(), signal.SIGTERM); " + SLEEP
)


def _model_name_then_mark(url: str, key: str | None) -> str:
    with open(READY_MARK, "w"):
        pass
    return "m"


class Recorded(up_supervisor.Stack):
    last: up_supervisor.Stack | None = None

    def __init__(self, env, policy=None) -> None:
        super().__init__(env, policy)
        Recorded.last = self


def run_with(
    monkeypatch,
    engine: str,
    router: str,
    healthy: bool = True,
    port: str = "0",
    flags: tuple[str, ...] = (),
) -> int:
    """`kvmesh up` with stand-in children, whose /health answers are ``healthy`` (from their
    own port: not asked)."""
    monkeypatch.setattr(up, "engine_command", lambda *a: [sys.executable, "-c", engine])
    monkeypatch.setattr(up, "router_command", lambda *a: [sys.executable, "-c", router])
    monkeypatch.setattr(up_supervisor, "_healthy", lambda url: healthy)
    monkeypatch.setattr(up_supervisor, "_listens", lambda pid, port: True)
    with contextlib.suppress(FileNotFoundError):  # a mark no engine consumed
        os.remove(READY_MARK)
    monkeypatch.setattr(up, "_model_name", _model_name_then_mark)
    monkeypatch.setattr(up_supervisor, "GRACE_S", 0.5)
    monkeypatch.setattr(up_supervisor, "ROUTER_DRAIN_S", 0.0)
    monkeypatch.setattr(up, "Stack", Recorded)
    Recorded.last = None
    args = build_parser().parse_args(["up", "--port", port, *flags])
    return up.run_up(_engine_config(args), None, args)


def children_gone() -> dict[str, int | None]:
    assert Recorded.last is not None
    return {name: child.proc.poll() for name, child in Recorded.last.children.items()}


def test_sigterm_is_forwarded_and_a_child_that_ignores_it_is_killed(monkeypatch, capsys):
    assert run_with(monkeypatch, IGNORES_SIGTERM, SLEEP) == 0
    assert children_gone() == {"engine": -signal.SIGKILL, "router": -signal.SIGTERM}
    assert "/v1 (router; model m; engine http://127.0.0.1:" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is not Recorded.last.on_signal  # handlers restored


def test_port_0_puts_router_and_engines_on_a_run_of_free_ports(monkeypatch, capsys):
    assert run_with(monkeypatch, IGNORES_SIGTERM, SLEEP, port="0") == 0
    out = capsys.readouterr().out
    start = out.split("starting the engine (loading its model) on port ")[1]
    engine_port, router_port = int(start.split(",")[0]), int(start.split("router on port ")[1][:5])
    assert engine_port == router_port + 1 and 1024 < router_port < 32_000
    assert f"kvmesh ready: http://127.0.0.1:{router_port}/v1" in out
    base = up.free_run(4)
    for port in range(base, base + 4):  # all free together
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_without_restarts_a_child_that_dies_stops_the_others_and_up_exits_with_its_code(
    monkeypatch, capsys
):
    dies = f"import os, sys, time\nwhile not os.path.exists({READY_MARK!r}): time.sleep(0.02)\n"
    dies += f"os.remove({READY_MARK!r}); sys.exit(3)"
    assert run_with(monkeypatch, SLEEP, dies, flags=("--no-restart-children",)) == 3
    assert children_gone() == {"engine": -signal.SIGTERM, "router": 3}
    assert "the router exited with code 3" in capsys.readouterr().err


def test_an_engine_that_fails_to_start_ends_up_before_the_router_starts(monkeypatch, capsys):
    refused = "import sys; print('kvmesh serve: bad tier path', file=sys.stderr); sys.exit(2)"
    assert run_with(monkeypatch, refused, SLEEP, healthy=False) == 2
    assert children_gone() == {"engine": 2}
    assert "kvmesh ready" not in capsys.readouterr().out


def stream(url: str, done: list[str]) -> None:
    body = json.dumps({"prompt": "a story " * 50, "max_tokens": 3000, "stream": True}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            while resp.read(256):
                pass
        done.append("ended")
    except (OSError, http.client.HTTPException) as exc:  # a stream cut short: IncompleteRead
        done.append(type(exc).__name__)


@pytest.mark.slow  # about 15 s on a small host: two interpreters load the tokenizer
def test_kvmesh_up_under_load_stops_on_sigterm_and_leaves_no_process():
    port = up.free_run(3)
    cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "up", "--emulate", "2"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("kvmesh ready"):
                break
        else:
            pytest.fail(f"kvmesh up exited {proc.wait()} before it was ready")
        children = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()]
        assert len(children) == 2  # the engines' process and the router's
        done: list[str] = []
        url = f"http://127.0.0.1:{port}/v1/completions"
        clients = [threading.Thread(target=stream, args=(url, done)) for _ in range(8)]
        for c in clients:
            c.start()
        time.sleep(1.5)  # the streams are under way
        assert not done
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for c in clients:
            c.join(timeout=30)
        assert len(done) == 8  # every stream was ended, none left hanging
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# writes its name to argv[1] when SIGTERM comes, once it has said (argv[1].ready-NAME) that it
# listens for it
_NOTES_SIGTERM = """
import signal, sys, time
def bye(*_):
    with open(sys.argv[1], "a") as f:
        f.write(sys.argv[2] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
open(sys.argv[1] + ".ready-" + sys.argv[2], "w").close()
while True:
    time.sleep(1)
"""


def test_the_router_stops_first_and_the_engines_serve_while_it_drains(tmp_path):
    """`up` stops its children last started first: the router gets SIGTERM and drains its
    answers in progress (its grace is GRACE_S + its drain time) while the engines still run;
    only then do the engines get theirs."""
    order = tmp_path / "order"
    stack = up_supervisor.Stack(dict(os.environ))
    for name, drain in (("engine", 0.0), ("router", 30.0)):
        cmd = [sys.executable, "-c", _NOTES_SIGTERM, str(order), name]
        child = stack.start(name, name, cmd, [], drain=drain)
        assert child.drain == drain
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"order.ready-{n}").exists() for n in ("engine", "router")):
        assert time.monotonic() < deadline, "the stand-in children did not start"
        time.sleep(0.05)
    stack.stop()
    assert order.read_text().split() == ["router", "engine"]
    assert all(child.proc.poll() == 0 for child in stack.children.values())
