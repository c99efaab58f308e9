"""The router's whole request path in process, without sockets: a client's request bytes into
the front door, parsing, the pick, the forward's bookkeeping and proxying, and a canned engine
answer back through the same callbacks to the client. What is timed is the router's own CPU
(`time.process_time`) per answered request: the Python and C work every request costs on top
of the system calls, which are the same for every preset (and every router). Unlike the closed
loop over real sockets, which shares two cores with the engines and the client, it repeats to
within a few percent, so it shows what a preset costs over round robin.

Two endpoints, each with idle keep-alive connections that answer at once; one client
connection, one request at a time; `repeated`: the closed loop's small prompt every time (its
token ids and block keys come from the router's caches), `new`: a prompt not seen before each
time (tokenized and hashed), `extended`: the latency cases' ~8,000-character prompt with a new
tail each time (an agent's next turn: its known prefix is reused, only the tail is encoded).

    .venv/bin/python benchmarks/router_path.py [--presets kvmesh,precise-prefix,round-robin]
        [-n 10000] [--rounds 3] [--json]

benchmarks/router_path_stages.py breaks the same path down stage by stage."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable

from kvmesh.bench.router_client import prompt_text
from kvmesh.router.app import Router, RouterConfig
from kvmesh.router.frontdoor import FrontDoor
from kvmesh.router.proxy import Upstream

ENDPOINTS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
PROMPT = "Say hello to the router benchmark"
_BODY = json.dumps(
    {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": " hi", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
    }
).encode()
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_BODY),
    _BODY,
)


class _Transport:
    """A transport that keeps nothing but what the path needs: written bytes go to `sent`."""

    def __init__(self, sent: list) -> None:
        self.sent = sent

    def get_extra_info(self, name: str, default=None):
        return default

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def writelines(self, data) -> None:
        self.sent.append(b"".join(data))

    def close(self) -> None:
        pass

    abort = pause_reading = resume_reading = close

    def is_closing(self) -> bool:
        return False


class _Engine(_Transport):
    """An upstream connection's transport: a request written to it is queued to be answered."""

    def __init__(self, conn: Upstream, asked: list) -> None:
        super().__init__(asked)
        self.conn = conn

    def write(self, data: bytes) -> None:
        self.sent.append(self.conn)

    def writelines(self, data) -> None:
        self.sent.append(self.conn)


def request_bytes(prompt: str) -> bytes:
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, "model": "m"})
    head = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())


def _path(preset: str, tokenizer) -> tuple[Callable[[bytes], None], list[bytes]]:
    """A router in process with canned engines: a function that serves one request's bytes,
    and the list the client's answers are written to."""
    router = Router(
        RouterConfig(endpoints=ENDPOINTS, preset=preset, kv_events=None, engine_model_check=False),
        tokenizer,
    )
    asked: list[Upstream] = []
    for e in router.pool.endpoints.values():
        link = router.link(e)
        for _ in range(4):
            conn = Upstream(link.pool)
            conn.connection_made(_Engine(conn, asked))
            link.pool.idle.append(conn)
    door = FrontDoor(router.handle, router.config.max_body_bytes, set())
    client: list[bytes] = []
    door.connection_made(_Transport(client))

    def serve(raw: bytes) -> None:
        door.data_received(raw)
        while asked:
            asked.pop().data_received(ANSWER)

    return serve, client


async def _time_path(preset: str, tokenizer, requests: list[bytes], warmup: int) -> float:
    serve, client = _path(preset, tokenizer)
    for raw in requests[:warmup]:
        serve(raw)
    client.clear()
    t0 = time.process_time()
    for raw in requests[warmup:]:
        serve(raw)
    cpu = time.process_time() - t0
    answered = sum(1 for data in client if data.startswith(b"HTTP/1.1 200"))
    if answered != len(requests) - warmup:
        raise RuntimeError(f"{preset}: {answered} of {len(requests) - warmup} answered")
    return cpu / answered * 1e6


def run_path(presets: list[str], n: int, rounds: int, tokenizer=None) -> dict:
    """Router CPU per request, µs, for each preset and prompt kind: the least of `rounds`
    (each `n` requests after a warm-up), and every round's figure."""
    if tokenizer is None:
        from kvmesh.engine.tokenizer import load_tokenizer

        tokenizer, _ = load_tokenizer(None)
    warmup = max(50, n // 10)
    long = prompt_text("long")
    kinds = {
        "repeated": [request_bytes(PROMPT)] * (warmup + n),
        "new": [request_bytes(f"{PROMPT} {i}") for i in range(warmup + n)],
        "extended": [request_bytes(f"{long} #{i}") for i in range(warmup + n)],
    }
    out: dict = {"requests": n, "rounds": rounds, "presets": {}}
    for preset in presets:
        out["presets"][preset] = {kind: [] for kind in kinds}
    for _ in range(rounds):  # every preset in turn, so a busy moment hits them alike
        for preset in presets:
            for kind, requests in kinds.items():
                us = asyncio.run(_time_path(preset, tokenizer, requests, warmup))
                out["presets"][preset][kind].append(round(us, 2))
    for figures in out["presets"].values():
        for kind in kinds:
            runs = figures[kind]
            figures[kind] = {"us": min(runs), "runs": runs}
    return out


def print_table(path: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=(
            "in-process request path (no sockets), router CPU us per request, the least of "
            f"{path['rounds']} rounds of {path['requests']}"
        )
    )
    cols = ("small prompt repeated", "small prompt new each time", "8k chars, new tail")
    for col in ("preset", *cols):
        t.add_column(col, justify="left" if col == "preset" else "right")
    base = path["presets"].get("round-robin")
    for preset, figures in path["presets"].items():
        cells = []
        for kind in ("repeated", "new", "extended"):
            us = figures[kind]["us"]
            over = base and preset != "round-robin"
            cells.append(f"{us:.1f}" + (f" (+{us - base[kind]['us']:.1f})" if over else ""))
        t.add_row(preset, *cells)
    Console().print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", default="kvmesh,precise-prefix,round-robin", help="router presets")
    p.add_argument("-n", type=int, default=10_000, help="timed requests per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each figure is their least")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    presets = [x.strip() for x in args.presets.split(",") if x.strip()]
    path = run_path(presets, args.n, args.rounds)
    if args.json:
        print(json.dumps(path, indent=2))
    else:
        print_table(path)


if __name__ == "__main__":
    main()
