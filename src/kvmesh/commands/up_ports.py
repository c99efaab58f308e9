"""The ports of `kvmesh up`: whether each can be listened on before anything starts, who holds
one that cannot, and whether a port answering is held by a process `up` started (so that
another instance answering /health is never taken for ours). Who holds a port is read from
Linux's /proc (sockets in LISTEN state, then which process has that socket open); elsewhere,
or for another user's process, it is unknown."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path

PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def cannot_listen(host: str, port: int) -> OSError | None:
    """None when a server could listen on host:port now (bound as servers bind: SO_REUSEADDR,
    so a port whose old connections wait in TIME_WAIT counts as free); else the error."""
    try:
        passive = socket.AI_PASSIVE
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=passive)
    except socket.gaierror as exc:
        return OSError(errno.EADDRNOTAVAIL, str(exc))
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                return exc
    return None


def listening_inodes(port: int) -> set[int] | None:
    """The inodes of the TCP sockets listening on port; None when /proc cannot tell."""
    found, read = set(), False
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(cols[9]))
    return found if read else None


def socket_holders(inodes: set[int]) -> set[int]:
    """The pids of the processes (of those this one may look into) that hold these sockets."""
    wanted = {f"socket:[{i}]" for i in inodes}
    pids: set[int] = set()
    for proc in PROC.glob("[0-9]*"):
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    pids.add(int(proc.name))
                    break
        except OSError:  # gone meanwhile, or another user's
            continue
    return pids


def port_holders(port: int) -> set[int] | None:
    """The pids listening on port (empty: none we can see); None when /proc cannot tell."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    return socket_holders(inodes) if inodes else set()


def descendants(pid: int) -> set[int]:
    """pid and every process below it (a server that runs its ranks as child processes)."""
    parents: dict[int, list[int]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[-1].split()  # after "(comm)", which may hold spaces
        if len(fields) > 1:
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += parents.get(p, [])
    return out


def listens_on(pid: int, port: int) -> bool:
    """Whether the process pid (or one below it) listens on port; True when /proc cannot
    tell (then only `up`'s own checks stand: the port was free, the child runs)."""
    holders = port_holders(port)
    if holders is None:
        return True
    return bool(holders & descendants(pid))


def describe(pid: int) -> str:
    """'pid N (its command line)', shortened to a readable length."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
        command = " ".join(" ".join(a.decode(errors="replace").split()) for a in argv if a)
    except OSError:
        return f"pid {pid}"
    if len(command) > 120:
        command = command[:117] + "..."
    return f"pid {pid} ({command})" if command else f"pid {pid}"


def taken(host: str, ports: dict[int, str]) -> list[str]:
    """One line per port of ``ports`` (port -> what `up` runs there) that cannot be listened
    on: which, for what, and what holds it when that can be known."""
    lines = []
    for port, role in ports.items():
        error = cannot_listen(host, port)
        if error is None:
            continue
        if error.errno != errno.EADDRINUSE:
            lines.append(f"port {port} ({role}) cannot be listened on at {host}: {error}")
            continue
        holders = port_holders(port)
        if holders:
            who = "by " + ", ".join(describe(p) for p in sorted(holders))
        elif holders is None:
            who = "by another process"
        else:
            who = "by a process this user cannot look into"
        lines.append(f"port {port} ({role}) is taken {who}")
    return lines
