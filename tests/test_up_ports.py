"""`kvmesh up` checks every port it will use before it starts anything, and says which is taken
and by what; a /health answer counts only from a port its own child listens on, never from
another instance that answers there."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvmesh.cli import build_parser, main
from kvmesh.commands import up, up_ports, up_supervisor
from kvmesh.commands.serve import _engine_config
from tests.test_up_supervisor import IGNORES_SIGTERM, READY_MARK, _model_name_then_mark


def never_started(*args, **kwargs):
    raise AssertionError("a child was started")


@pytest.mark.parametrize(("held", "role"), [(0, "the router's"), (2, "engine 1's")])
def test_a_taken_port_is_named_with_its_holder_and_nothing_starts(monkeypatch, capsys, held, role):
    base = up.free_run(3)
    with socket.create_server(("127.0.0.1", base + held)):
        monkeypatch.setattr(up, "Stack", never_started)
        assert main(["up", "--emulate", "2", "--port", str(base)]) == 2
    err = capsys.readouterr().err
    assert f"kvmesh up: port {base + held} ({role}) is taken by pid {os.getpid()} (" in err
    assert "nothing started" in err and "Traceback" not in err


def test_the_holders_of_a_port_are_read_from_proc():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert up_ports.port_holders(port) == {os.getpid()}
        assert up_ports.listens_on(os.getpid(), port)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", "input()"], stdin=-1)
        try:
            assert not up_ports.listens_on(child.pid, port)  # ours, not the child's
        finally:
            child.kill()
            child.wait()


class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_another_instance_answering_on_the_engine_port_is_not_taken_for_ours(
    monkeypatch, capsys, tmp_path: Path
):
    """The port is taken after `up` checked it (a race); the other instance answers /health;
    our engine cannot listen and exits. `up` never calls the engine healthy nor the stack
    ready: it waits for its own child, and ends with the child's code."""
    base = up.free_run(2)
    other = http.server.ThreadingHTTPServer(("127.0.0.1", base + 1), Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    asked = tmp_path / "asked"
    real_healthy, answers = up_supervisor._healthy, []

    def counted(url: str) -> bool:
        answers.append(real_healthy(url))
        if len(answers) == 3:
            asked.touch()
        return answers[-1]

    # the engine: exits once `up` has had three 200s from the other instance
    engine = f"import os, sys, time\nwhile not os.path.exists({str(asked)!r}): time.sleep(0.02)\n"
    engine += "print('address already in use', file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(up_ports, "taken", lambda host, ports: [])  # checked before it was
    monkeypatch.setattr(up, "engine_command", lambda *a: [sys.executable, "-c", engine])
    monkeypatch.setattr(up, "router_command", lambda *a: [sys.executable, "-c", IGNORES_SIGTERM])
    monkeypatch.setattr(up_supervisor, "_healthy", counted)
    monkeypatch.setattr(up, "_model_name", _model_name_then_mark)
    monkeypatch.setattr(up_supervisor, "GRACE_S", 0.5)
    monkeypatch.setattr(up_supervisor, "ROUTER_DRAIN_S", 0.0)
    args = build_parser().parse_args(["up", "--port", str(base)])
    try:
        code = up.run_up(_engine_config(args), None, args)
    finally:
        other.shutdown()
        other.server_close()
        if os.path.exists(READY_MARK):
            os.remove(READY_MARK)
    out = capsys.readouterr()
    assert answers[:3] == [True, True, True]  # the other instance did answer
    assert code == 1 and "the engine exited with code 1" in out.err
    assert "answers /health" not in out.out and "kvmesh ready" not in out.out
