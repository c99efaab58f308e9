"""The disk tier's file: created exclusively, never through a symlink, 0600, removed on close."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from kvmesh.engine.tier_storage import DiskTierStorage

SHAPE = (2, 2, 4, 1, 8)


def test_symlinked_path_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "tier.bin"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="kv-offloading-disk-path"):
        DiskTierStorage(str(link), 4, SHAPE, torch.float32)
    assert target.read_text() == "keep me"


def test_existing_file_is_refused_not_truncated(tmp_path):
    path = tmp_path / "tier.bin"
    path.write_text("someone's data")
    with pytest.raises(ValueError, match="exists"):
        DiskTierStorage(str(path), 4, SHAPE, torch.float32)
    assert path.read_text() == "someone's data"


@pytest.mark.parametrize("in_directory", [True, False])
def test_file_is_private_and_removed_on_close(tmp_path, in_directory):
    given = tmp_path if in_directory else tmp_path / "tier.bin"
    store = DiskTierStorage(str(given), 4, SHAPE, torch.float32)
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    blocks = torch.randn(2, *SHAPE)
    store.write([1, 3], blocks)
    assert torch.equal(store.read([3, 1]), blocks.flip(0))
    store.close()
    assert not os.path.exists(store.path) and list(tmp_path.iterdir()) == []


def test_orphans_of_dead_engines_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    orphan = tmp_path / f"kvmesh-kv-{dead}-abc.bin"
    orphan.write_bytes(b"x")
    alive = tmp_path / f"kvmesh-kv-{os.getpid()}-def.bin"
    alive.write_bytes(b"x")
    other = tmp_path / "notes.txt"
    other.write_text("not ours")
    store = DiskTierStorage(str(tmp_path), 2, SHAPE, torch.float32)
    try:
        assert not orphan.exists() and alive.exists() and other.exists()
    finally:
        store.close()
