"""Real vLLM servers and a `kvmesh router` as subprocesses of the test session.

Each runs in its own process group (vLLM forks an engine core and workers), so stopping one
ends the whole group. Every wait has a deadline and fails with the process's log tail.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger("kvmesh.tests.vllm")  # shown live by `make test-vllm`
SERVED_MODEL = "smollm2"
BLOCK_SIZE = 32  # vLLM's CPU backend takes only multiples of 32
HASH_ALGO = "sha256"
HASH_SEED = "0"  # PYTHONHASHSEED of every vLLM instance and of the router: one NONE_HASH
MAX_MODEL_LEN = 512
START_TIMEOUT = 420.0  # a cold start compiles; two cores are shared with other work

# what every vLLM process needs on a 2-core box with no network
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONHASHSEED": HASH_SEED,
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning: servers share the two cores
    "OMP_NUM_THREADS": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def free_port(consecutive: int = 1) -> int:
    """A loopback port p with p .. p+consecutive-1 all free just now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + consecutive > 65535:
            continue
        if all(_free(port + i) for i in range(1, consecutive)):
            return port
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def offset_port(endpoint: str, rank: int) -> str:
    """A data-parallel rank's publisher endpoint: vLLM adds the rank to the TCP port."""
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}"


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON body or text) of one request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            raw, status, head = resp.read(), resp.status, resp.headers
    except urllib.error.HTTPError as exc:
        raw, status, head = exc.read(), exc.code, exc.headers
    text = raw.decode()
    try:
        return status, head, json.loads(text)
    except ValueError:
        return status, head, text


class Process:
    def __init__(self, name: str, argv: list[str], env: dict, log: Path, url: str) -> None:
        self.name, self.url, self.log = name, url, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: vLLM's children end with it
            )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Until GET /health answers 200, saying every 15 s how long it has waited (a cold
        vLLM start takes a minute alone, several with others starting beside it)."""
        started = time.monotonic()
        deadline, said = started + timeout, started
        logger.info("%s: starting (log %s), waiting for /health", self.name, self.log)
        while time.monotonic() < deadline:
            if time.monotonic() - said >= 15:
                said = time.monotonic()
                logger.info("%s: still starting, %.0f s so far", self.name, said - started)
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"{self.name} exited ({code}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        took = time.monotonic() - started
                        logger.info("%s: healthy after %.0f s", self.name, took)
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not healthy in {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # our own group, made at start
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass


def start_vllm(
    python: Path,
    model_dir: Path,
    log_dir: Path,
    name: str,
    *,
    num_blocks: int | None = None,
    extra: tuple[str, ...] | list[str] = (),
    event_ranks: int = 1,
) -> tuple[Process, dict]:
    """A vLLM OpenAI server with ZMQ KV events (PUB binds tcp://*:port, replay on its own
    port; each data-parallel rank offsets both). Returns the process and its events config."""
    port = free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port(event_ranks)}",
        "replay_endpoint": f"tcp://*:{free_port(event_ranks)}",
        "topic": "kv",
    }
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "4",
        "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", HASH_ALGO,
        "--enable-prompt-tokens-details",
        "--enforce-eager",  # no torch.compile: starts in about a minute on two cores
        "--kv-events-config", json.dumps(events),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(num_blocks)]
    argv += list(extra)
    proc = Process(name, argv, VLLM_ENV, log_dir / f"{name}.log", f"http://127.0.0.1:{port}")
    return proc, events


def start_router(endpoints: list[str], tokenizer_dir: Path, log_dir: Path) -> Process:
    port = free_port()
    argv = [
        sys.executable, "-m", "kvmesh.cli", "router",
        *[a for url in endpoints for a in ("--endpoint", url)],
        "--port", str(port),
        "--block-size", str(BLOCK_SIZE),
        "--prefix-caching-hash-algo", HASH_ALGO,
        "--model", str(tokenizer_dir),
        "--scrape-interval", "0.2",
    ]  # fmt: skip
    env = {"PYTHONHASHSEED": HASH_SEED, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return Process("router", argv, env, log_dir / "router.log", f"http://127.0.0.1:{port}")
