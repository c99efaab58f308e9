"""`kvmesh router` as a user starts it: what its ready line says."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import yaml

from tests.helpers import free_port


def test_ready_line_counts_the_endpoints_file_and_names_the_bound_port(tmp_path) -> None:
    path = tmp_path / "endpoints.yaml"
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]  # nobody there
    path.write_text(yaml.safe_dump(urls))
    cmd = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router"]
    cmd += ["--endpoints-file", str(path), "--port", "0", "--preset", "round-robin"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, line = time.monotonic() + 60, ""
        while time.monotonic() < deadline and "ready" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "router exited before it was ready"
        match = re.search(
            r"ready: http://127\.0\.0\.1:(\d+)/v1 \((\d+) endpoints, (\d+) healthy", line
        )
        assert match, line
        port, endpoints, healthy = map(int, match.groups())
        assert port > 0 and endpoints == 2 and healthy == 0  # both unreachable
    finally:
        proc.terminate()
        proc.wait(timeout=15)
