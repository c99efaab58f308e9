"""Envoy in front of the bench's engines with kvmesh as its endpoint picker (ext_proc), run as
one router under test: `python -m kvmesh.bench.envoy_epp --port P --preset X --endpoint URL ...`.

It starts `kvmesh router --ext-proc-port` and Envoy with docs/envoy-ext-proc.yaml (the
Inference Extension's data path: an ORIGINAL_DST cluster routing on the picker's header), Envoy
listening on P. Both stay in this process's group, so the bench's stop (a signal to the group)
ends them and its CPU reading (the group and its descendants) counts them both. Exits when either
exits, taking the other with it. bench.fleet_procs.routers, the launcher of the routers under test,
finds Envoy and its config (envoy_binary, DOC_CONFIG) and starts this module as a process.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kvmesh.bench.fleet_procs.ports import free_port
from kvmesh.bench.fleet_procs.routers import DOC_CONFIG, envoy_binary


def envoy_config(listen_port: int, ext_proc_port: int) -> dict:
    """docs/envoy-ext-proc.yaml with Envoy on listen_port and the picker on ext_proc_port."""
    config = yaml.safe_load(DOC_CONFIG.read_text())
    config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = (
        listen_port
    )
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "kvmesh_epp":
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            endpoint["address"]["socket_address"]["port_value"] = ext_proc_port
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="Envoy's listener port.")
    p.add_argument("--preset", default="kvmesh", help="The picker's scheduler preset.")
    p.add_argument("--endpoint", action="append", required=True, help="Engine URL (repeat).")
    p.add_argument("--envoy-bin", default=None, help="Envoy executable.")
    args = p.parse_args(argv)
    binary = envoy_binary(args.envoy_bin)
    if binary is None:
        print("envoy_epp: no envoy binary or no docs/envoy-ext-proc.yaml", file=sys.stderr)
        return 2
    ext_port, http_port = free_port(), free_port()
    router = [sys.executable, "-m", "kvmesh.cli", "--log-level", "WARNING", "router"]
    for url in args.endpoint:
        router += ["--endpoint", url]
    router += ["--host", "127.0.0.1", "--port", str(http_port), "--preset", args.preset]
    router += ["--ext-proc-port", str(ext_port)]
    children = [subprocess.Popen(router)]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(yaml.safe_dump(envoy_config(args.port, ext_port)))
        envoy = [binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
        children.append(subprocess.Popen([*envoy, "-l", "warning"]))
        while not stopping and all(c.poll() is None for c in children):
            time.sleep(0.2)
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(timeout=10)
            except subprocess.TimeoutExpired:
                c.kill()
    return 0 if stopping else 1


if __name__ == "__main__":
    sys.exit(main())
