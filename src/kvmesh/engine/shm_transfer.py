"""Shared-memory transport for peer pulls between engines on one host.

The puller asks `POST /kv_transfer/blocks` with `"transport": "shm"`. A peer on the same host
writes the usual transfer payload (JSON header with the block hashes and the KV's XXH3-64, then
the raw KV) into a fresh POSIX shared-memory segment, a file under /dev/shm, and answers
`{"shm_name": ..., "size": ...}` instead of the bytes. The puller maps the segment read-only and
imports from the mapping through the same verified import as an HTTP payload, without copying
it into a buffer of its own first.

Invariants:
- a segment's name is `kvmesh-kv-` + 32 fresh hex digits, never reused: a late unlink removes
  only the segment it was made for, and a puller never opens or unlinks a file not named so;
- the puller unlinks a segment as soon as it has opened it, before reading it; the peer unlinks
  it only if it still exists `ttl` seconds after answering (the puller never came) or when the
  peer shuts down. Either way the name is gone once, and no process is left holding it;
- a segment that cannot be opened, or whose size differs from the answer, makes the puller ask
  again for the bytes over TCP; one that fails verification is recomputed, like a bad payload;
- a peer keeps at most `max_segments` segments, and `max_share` of the /dev/shm filesystem,
  written and not yet collected (counting those being written); past either it answers with
  the bytes, so no caller can fill /dev/shm by asking and never collecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import mmap
import os
import re
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "kvmesh-kv-"
NAME_RE = re.compile(r"kvmesh-kv-[0-9a-f]{32}")
SEGMENT_TTL_S = 60.0
MAX_SEGMENTS = 16
MAX_SHARE = 0.25  # of /dev/shm's size, outstanding at once


def available(directory: Path = SHM_DIR) -> bool:
    """Whether segments can be made here (Linux's /dev/shm; absent on macOS: TCP is used)."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


def is_local_host(host: str, own_host: str | None = None) -> bool:
    """A peer address that names this host: loopback, or the host this engine advertises."""
    if host == "localhost" or (own_host and host == own_host):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def same_host(remote: str | None, sockname: tuple | None) -> bool:
    """A connection between two processes of one host: loopback, or both ends on one address
    (`sockname`: this end's socket address)."""
    if not remote:
        return False
    return is_local_host(remote) or (bool(sockname) and remote == sockname[0])


class SegmentWriter:
    """The peer's side: writes payloads into segments and unlinks the ones never collected."""

    def __init__(
        self,
        directory: Path = SHM_DIR,
        ttl: float = SEGMENT_TTL_S,
        max_segments: int = MAX_SEGMENTS,
        max_share: float = MAX_SHARE,
    ) -> None:
        self.directory = directory
        self.ttl = ttl
        self.max_segments = max_segments
        self.max_share = max_share
        self.pending: dict[str, tuple[asyncio.TimerHandle, int]] = {}  # by name: (expiry, size)
        self.writing: list[int] = []  # sizes of the segments being written now

    def _prune(self) -> None:
        """Forget the segments their pullers collected (unlinked): they hold no /dev/shm."""
        for name, (timer, _) in list(self.pending.items()):
            if not (self.directory / name).exists():
                timer.cancel()
                del self.pending[name]

    def has_room(self, size: int) -> bool:
        """Whether one more segment of `size` bytes stays within the outstanding limits."""
        self._prune()
        if len(self.pending) + len(self.writing) >= self.max_segments:
            return False
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return False
        outstanding = sum(s for _, s in self.pending.values()) + sum(self.writing)
        return outstanding + size <= self.max_share * fs.f_blocks * fs.f_frsize

    def write(self, parts: list) -> dict | None:
        """The payload parts in a new segment: its answer, or None (no room, no /dev/shm)."""
        size = sum(len(p) for p in parts)
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return None
        if fs.f_bavail * fs.f_frsize < size:
            return None
        name = NAME_PREFIX + uuid.uuid4().hex
        path = self.directory / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                for part in parts:
                    f.write(part)
        except OSError as exc:  # e.g. a tmpfs smaller than statvfs said: ENOSPC
            logger.warning("KV shared-memory segment not written (%s); sending bytes", exc)
            path.unlink(missing_ok=True)
            return None
        return {"shm_name": name, "size": size}

    async def answer(self, parts: list) -> dict | None:
        """Write off the event loop; the segment is unlinked after ttl unless collected.
        None (send the bytes instead) past the outstanding limits."""
        size = sum(len(p) for p in parts)
        if not self.has_room(size):
            logger.warning("KV shared-memory segments at their limit; sending bytes")
            return None
        self.writing.append(size)
        try:
            segment = await asyncio.to_thread(self.write, parts)
        finally:
            self.writing.remove(size)
        if segment is not None:
            name = segment["shm_name"]
            loop = asyncio.get_running_loop()
            self.pending[name] = (loop.call_later(self.ttl, self.expire, name), size)
        return segment

    def expire(self, name: str) -> None:
        self.pending.pop(name, None)
        with contextlib.suppress(FileNotFoundError):  # the puller unlinked it: the usual case
            (self.directory / name).unlink()
            logger.warning("KV shared-memory segment %s was never collected; removed", name)

    def close(self) -> None:
        for name, (timer, _) in list(self.pending.items()):
            timer.cancel()
            self.expire(name)


def open_segment(answer: dict, directory: Path = SHM_DIR) -> mmap.mmap:
    """Map a peer's segment read-only and unlink it; OSError or ValueError if it is not usable."""
    name, size = answer.get("shm_name"), answer.get("size")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(f"not a kvmesh segment name: {name!r}")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"bad segment size {size!r}")
    path = directory / name
    fd = os.open(path, os.O_RDONLY)
    try:
        path.unlink(missing_ok=True)  # from here only this mapping keeps the memory
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"segment {name} holds {actual} bytes, the peer said {size}")
        # pages are mapped up front (MAP_POPULATE): one call, not a fault per page on reading
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def import_segment(core, request, answer: dict) -> tuple[int, float] | None:
    """On the engine thread: import a segment through core.import_payload (hashes and checksum
    verified there). (tokens imported, modelled transfer delay), or None if it was unreadable."""
    try:
        mapping = open_segment(answer)
    except (OSError, ValueError) as exc:
        logger.warning("KV shared-memory segment unreadable (%s); asking over TCP", exc)
        return None
    view = memoryview(mapping)
    try:
        return core.import_payload(request, view), core.last_import_seconds
    finally:
        # a view still exported (BufferError): unmapped when the last one is collected
        with contextlib.suppress(BufferError):
            view.release()
            mapping.close()
