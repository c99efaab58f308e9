"""Ports for a benchmark's servers: one free port, or a run of free ones (an engine's KV events
and replay ports, a fleet on fixed ports that restarts where its router looks for it)."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def taken_ports(base: int, count: int, host: str = "127.0.0.1") -> list[int]:
    """Of base .. base+count-1, the ports that cannot be bound now."""
    taken = []
    for port in range(base, base + count):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                taken.append(port)
    return taken


def free_run(count: int) -> int:
    """A port P with P..P+count-1 free, P picked by the system (in the ephemeral range)."""
    for _ in range(50):
        base = free_port()
        if base + count <= 65536 and not taken_ports(base, count):
            return base
    raise RuntimeError(f"no {count} free ports in a row")


def port_block(count: int) -> int:
    """A base P with P..P+count-1 free, below Linux's ephemeral ports (32768 up), so that no
    outgoing connection takes the port of an engine while it is down for a restart."""
    for _ in range(200):
        base = random.randrange(10_000, 32_000 - count)
        if not taken_ports(base, count, "0.0.0.0"):
            return base
    raise RuntimeError(f"no {count} free ports in a row below 32000")
