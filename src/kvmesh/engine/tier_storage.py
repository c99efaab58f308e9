"""Where a torch runner keeps offloaded KV: host memory and a file, in slot-major layout.

One slot holds one block across all layers, `[layers, 2 (K, V), block_size, kv_heads,
head_dim]`, contiguous, so a slot is a plain byte range (one pread/pwrite on disk).
"""

from __future__ import annotations

import contextlib
import os

import torch


class HostTierStorage:
    """Slots in host DRAM; pinned when the device is CUDA so copies can be asynchronous."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype, pin: bool) -> None:
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self.pinned = pin

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """blocks: [n, *block_shape] on any device; on CUDA the copy is enqueued, not awaited
        (pinned destination), so later reads on the same stream see it in order."""
        if blocks.device.type == "cpu":
            self.data[torch.tensor(slots, dtype=torch.long)] = blocks
            return
        for i, slot in enumerate(slots):
            self.data[slot].copy_(blocks[i], non_blocking=self.pinned)

    def read(self, slots: list[int]) -> torch.Tensor:
        out = self.data[torch.tensor(slots, dtype=torch.long)]
        return out.pin_memory() if self.pinned else out


_PREFIX = "kvmesh-kv-"
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def _remove_orphans(directory: str) -> None:
    """Tier files of this user's engines that died without closing them (kill -9)."""
    for entry in os.scandir(directory):
        pid = entry.name.removeprefix(_PREFIX).split("-", 1)[0]
        if not entry.name.startswith(_PREFIX) or not pid.isdigit():
            continue
        try:
            if entry.is_symlink() or entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # alive: not an orphan
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        except OSError:
            continue


class DiskTierStorage:
    """Slots in one file. Writes are flushed and dropped from the page cache, so a later read
    really comes from the disk (what a tier below DRAM is for), not from DRAM in disguise."""

    def __init__(
        self, path: str, num_slots: int, block_shape: tuple[int, ...], dtype, drop_cache=True
    ) -> None:
        self.block_shape = block_shape
        self.dtype = dtype
        self.slot_bytes = dtype.itemsize
        for d in block_shape:
            self.slot_bytes *= d
        self.fd = -1
        if os.path.isdir(path):
            _remove_orphans(path)
            path = os.path.join(path, f"{_PREFIX}{os.getpid()}-{id(self):x}.bin")
        self.path = path
        try:  # never through a symlink, never over an existing file, readable by us alone
            self.fd = os.open(path, _CREATE_FLAGS, 0o600)
        except FileExistsError:
            raise ValueError(
                f"--kv-offloading-disk-path {path} exists: kvmesh creates its tier file itself "
                "(give a directory, or a path that does not exist yet)"
            ) from None
        except OSError as exc:  # ELOOP: the path is a symlink
            raise ValueError(f"--kv-offloading-disk-path {path}: {exc.strerror}") from None
        os.ftruncate(self.fd, num_slots * self.slot_bytes)
        self.drop_cache = drop_cache and hasattr(os, "posix_fadvise")

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        raw = blocks.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        for i, slot in enumerate(slots):
            os.pwrite(self.fd, raw[i].tobytes(), slot * self.slot_bytes)
        if self.drop_cache:
            os.fdatasync(self.fd)
            for slot in slots:
                offset = slot * self.slot_bytes
                os.posix_fadvise(self.fd, offset, self.slot_bytes, os.POSIX_FADV_DONTNEED)

    def read(self, slots: list[int]) -> torch.Tensor:
        buf = torch.empty((len(slots), self.slot_bytes), dtype=torch.uint8)  # not zeroed
        rows = buf.numpy()
        for i, slot in enumerate(slots):
            got = os.preadv(self.fd, [rows[i]], slot * self.slot_bytes)  # releases the GIL
            if got != self.slot_bytes:
                raise OSError(f"short read of KV slot {slot} from {self.path}")
            if self.drop_cache:
                offset = slot * self.slot_bytes
                os.posix_fadvise(self.fd, offset, self.slot_bytes, os.POSIX_FADV_DONTNEED)
        return buf.view(self.dtype).reshape(len(slots), *self.block_shape)

    def close(self) -> None:
        if self.fd >= 0:  # the file is ours (created exclusively): it goes with us
            os.close(self.fd)
            self.fd = -1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.close()
