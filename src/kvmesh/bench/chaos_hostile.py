"""The hostile client of `kvmesh bench chaos --hostile`: requests that a server must refuse,
sent over raw sockets to the router at a fixed rate while normal agentic load runs beside
them, each one's outcome recorded (its status, a close, a reset, or a timeout).

It runs as its own process (`python -m kvmesh.bench.chaos_hostile`), so that building and
sending megabytes never delays the event loop that times the normal clients' tokens. The
classes are those of issue 37's hardening round: oversized prompts, prompts of many distinct
words, request ids with CR / LF / NUL, fan-out lists, slowloris partial heads, malformed HTTP,
JSON nested 300 deep, 100,000 messages and a malformed Authorization header."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

from kvmesh.protocol.http_limits import REQUEST_READ_TIMEOUT_S

SECRET = "sk-hostile-SECRET-4f9c"  # the malformed Authorization's key: no answer may quote it
ANSWER_TIMEOUT_S = 10.0  # a request sent whole is answered within this, or it hangs
PARTIAL_TIMEOUT_S = REQUEST_READ_TIMEOUT_S + 15.0  # a partial request: the 408 and a margin
CLASSES = ("oversized-prompt", "distinct-words", "request-id", "fan-out", "slowloris")
CLASSES += ("malformed-http", "deep-json", "many-messages", "bad-authorization")
HEAD_LIMIT = 65_536  # bytes of an answer read for its status and a quoted secret


@dataclass(slots=True)
class HostileRecord:
    """One hostile request (one connection) as the hostile client saw it."""

    cls: str  # its class
    variant: str  # which form of the class
    start: float  # s since the run's t0
    seconds: float  # until its status line, the close, or the timeout
    status: int | None = None  # the answer's HTTP status; None: no answer
    end: str = "answer"  # answer | close (EOF, no answer) | reset | timeout | connect: <error>
    leaked: bool = False  # the answer quoted the request's secret


def _http(body: bytes, path: str = "/v1/completions", extra: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: kvmesh\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + extra + b"\r\n" + body


def _json(obj: object, path: str = "/v1/completions", extra: bytes = b"") -> bytes:
    return _http(json.dumps(obj).encode(), path, extra)


def _distinct_words(n_bytes: int, seed: int) -> str:
    """About n_bytes of words of 5 to 11 random letters: nearly every word a new one."""
    rng = random.Random(seed)
    letters = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=n_bytes))
    cuts = [0]
    while cuts[-1] < n_bytes:
        cuts.append(cuts[-1] + rng.randint(5, 11))
    return " ".join(letters[a:b] for a, b in zip(cuts, cuts[1:], strict=False))


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


def build_requests(model: str, mb: float = 8.0) -> dict[str, dict[str, bytes]]:
    """Each class's variants: name -> the bytes sent (slowloris: the partial head each of its
    connections sends). Built once: nothing is built while the run is timed."""
    big = int(mb * 1_000_000)
    chat = "/v1/chat/completions"
    msg = {"role": "user", "content": "hi"}
    hello = b'{"prompt": "hi", "max_tokens": 1}'
    post = b"POST /v1/completions HTTP/1.1\r\nHost: kvmesh\r\n"
    deep = b'{"model": "%s", "prompt": "hi", "max_tokens": 1, "x": %s}' % (
        model.encode(),
        _nested(300),
    )
    return {
        "oversized-prompt": {
            f"completion, {mb:g} MB": _json({"model": model, "prompt": "go " * (big // 3)}),
            f"chat, {mb:g} MB": _json(
                {"model": model, "messages": [{"role": "user", "content": "go " * (big // 3)}]},
                chat,
            ),
        },
        "distinct-words": {
            f"{mb / 2:g} MB of distinct words": _json(
                {"model": model, "prompt": _distinct_words(big // 2, 37), "max_tokens": 1}
            ),
        },
        "request-id": {
            f"body id with {name}": _json(
                {"model": model, "prompt": "hi", "max_tokens": 1, "request_id": rid}
            )
            for name, rid in (("CR LF", "a\r\nX-Evil: 1"), ("NUL", "a\x00b"), ("LF", "a\nb"))
        }
        | {"X-Request-Id header with NUL": _http(hello, extra=b"X-Request-Id: a\x00b\r\n")},
        "fan-out": {
            "10,000 prompts": _json({"model": model, "prompt": ["hi"] * 10_000, "max_tokens": 1}),
            "1,000 prompts x n 16": _json(
                {"model": model, "prompt": ["hi"] * 1000, "n": 16, "max_tokens": 1}
            ),
        },
        "slowloris": {"half a head": post + b"Content-Type: application/json\r\nContent-Le"},
        "malformed-http": {
            "Content-Length: abc": post + b"Content-Length: abc\r\n\r\n" + hello,
            "two Content-Lengths": post + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\n{}{}",
            "Content-Length beyond the body": post + b"Content-Length: 100\r\n\r\n" + hello,
            "Content-Encoding: gzip": _http(hello, extra=b"Content-Encoding: gzip\r\n"),
            "HTTP/0.9 request line": b"GET /v1/models HTTP/0.9\r\n\r\n",
            "HTTP/2.0 request line": b"GET /v1/models HTTP/2.0\r\nHost: kvmesh\r\n\r\n",
        },
        "deep-json": {"nested 300 deep": _http(deep)},
        "many-messages": {
            "100,000 messages": _json({"model": model, "messages": [msg] * 100_000}, chat)
        },
        "bad-authorization": {
            "control byte in the key": _http(
                hello, extra=f"Authorization: Bearer {SECRET}\x01x\r\n".encode()
            ),
            "no colon": _http(hello, extra=f"Authorization Bearer {SECRET}\r\n".encode()),
        },
    }


def partial(cls: str, variant: str) -> bool:
    """Whether the request is sent incomplete, so that only the server's read timeout ends it."""
    return cls == "slowloris" or variant == "Content-Length beyond the body"


def _status(head: bytes) -> int | None:
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    ok = len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit()
    return int(parts[1]) if ok else None


async def send(
    host: str, port: int, cls: str, variant: str, data: bytes, t0: float
) -> HostileRecord:
    """One connection: `data` written (the server may answer before it is all in), the answer
    read up to its head and a bounded body; the record of what came back and when."""
    start = time.perf_counter()
    rec = HostileRecord(cls, variant, round(start - t0, 3), 0.0)
    limit = PARTIAL_TIMEOUT_S if partial(cls, variant) else ANSWER_TIMEOUT_S
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), limit)
    except (OSError, TimeoutError) as exc:
        rec.end, rec.seconds = f"connect: {type(exc).__name__}", time.perf_counter() - start
        return rec

    async def write() -> None:
        with contextlib.suppress(OSError):
            writer.write(data)
            await writer.drain()

    writing = asyncio.create_task(write())
    got = b""
    try:
        async with asyncio.timeout(limit):
            while b"\r\n" not in got:
                chunk = await reader.read(65_536)
                if not chunk:
                    break
                got += chunk
            rec.seconds = time.perf_counter() - start
            with contextlib.suppress(TimeoutError, OSError):  # the rest: for a quoted key
                async with asyncio.timeout(1.0):
                    while got and len(got) < HEAD_LIMIT and (chunk := await reader.read(65_536)):
                        got += chunk
    except TimeoutError:
        rec.end = "timeout"
    except OSError:
        rec.end = "reset"
    if rec.end == "answer":
        rec.status = _status(got)
        rec.end = "answer" if rec.status is not None else ("close" if not got else "garbage")
    rec.seconds = round(rec.seconds or time.perf_counter() - start, 3)
    rec.leaked = SECRET.encode() in got
    writing.cancel()
    writer.transport.abort()
    return rec


def schedule(requests: dict[str, dict[str, bytes]], seed: int):
    """Endless (class, variant): the classes in a seeded shuffled cycle, each class's variants
    in turn, so that every class is sent at the same rate."""
    rng = random.Random(seed)
    turn = dict.fromkeys(requests, 0)
    while True:
        order = list(requests)
        rng.shuffle(order)
        for cls in order:
            names = list(requests[cls])
            yield cls, names[turn[cls] % len(names)]
            turn[cls] += 1


async def run(
    args: argparse.Namespace, requests: dict[str, dict[str, bytes]], t0: float
) -> list[HostileRecord]:
    """--rate hostile requests a second for --seconds (a slowloris one opens
    --slowloris-connections connections), then every one in flight to its end."""
    u = urlparse(args.url)
    tasks: list[asyncio.Task] = []
    began = time.perf_counter()
    for i, (cls, variant) in enumerate(schedule(requests, args.seed)):
        due = began + i / args.rate
        if due - began >= args.seconds:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        copies = args.slowloris_connections if cls == "slowloris" else 1
        data = requests[cls][variant]
        for _ in range(copies):
            tasks.append(asyncio.create_task(send(u.hostname, u.port, cls, variant, data, t0)))
    return list(await asyncio.gather(*tasks))


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", required=True, help="The router's URL.")
    a("--model", default="kvmesh", help="Model name in the bodies [kvmesh].")
    a("--seconds", type=float, required=True, help="How long to send, s.")
    a("--rate", type=float, default=2.0, help="Hostile requests a second [2].")
    a("--slowloris-connections", type=int, default=16, help="Connections per slowloris [16].")
    a("--prompt-mb", type=float, default=8.0, help="Oversized prompts' size, MB [8].")
    a("--seed", type=int, default=0, help="Order of the classes [0].")
    a("--classes", default="", help="Comma-separated classes to send [all].")
    a("--out", required=True, help="JSON file of the records.")


def main(argv: list[str] | None = None) -> int:
    """Builds every request, says `ready` on stdout, and starts sending when a line comes on
    stdin: the run's t0 (time.perf_counter() of the parent, the same clock), or empty: now."""
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bench.chaos_hostile")
    add_args(parser)
    args = parser.parse_args(argv)
    wanted = [c.strip() for c in args.classes.split(",") if c.strip()] or CLASSES
    if unknown := set(wanted) - set(CLASSES):
        parser.error(f"unknown classes: {', '.join(sorted(unknown))}; known: {', '.join(CLASSES)}")
    requests = {k: v for k, v in build_requests(args.model, args.prompt_mb).items() if k in wanted}
    print("ready", flush=True)
    line = sys.stdin.readline().strip()
    records = asyncio.run(run(args, requests, float(line) if line else time.perf_counter()))
    with open(args.out, "w") as f:
        json.dump([asdict(r) for r in records], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
