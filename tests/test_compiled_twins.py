"""The modules setup.py compiles run the same compiled and as their pure-Python source: the same
token ids, block keys and picks on one deterministic run of the request path (tests/
twin_scenario.py) in two processes, one with KVMESH_PURE_PYTHON=1. And a compiled module never
shadows its source once the source is newer (kvmesh/_fresh.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh import _fresh

SCENARIO = Path(__file__).with_name("twin_scenario.py")


def _run(pure: bool) -> dict:
    env = {**os.environ, "KVMESH_PURE_PYTHON": "1" if pure else "0"}
    done = subprocess.run(
        [sys.executable, str(SCENARIO)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_compiled_request_path_equals_its_pure_python_twin():
    compiled, pure = _run(pure=False), _run(pure=True)
    assert all(f.endswith(".py") for f in pure["modules"].values())
    assert all(not f.endswith(".py") for f in compiled["modules"].values()), (
        "setup.py's modules are not built: `make install`"
    )
    assert compiled["tokens"] == pure["tokens"]
    assert compiled["picks"] == pure["picks"]
    assert len(set(compiled["picks"])) == 2 and "" not in compiled["picks"]


def test_a_source_newer_than_its_build_is_what_runs(tmp_path, monkeypatch):
    pkg = tmp_path / "kvmesh_twin_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    source = pkg / "mod.py"
    source.write_text("WHERE = 'source'\n")
    suffix = _fresh._SUFFIXES[0]
    build = pkg / f"mod{suffix}"
    build.write_bytes(b"not a real extension")  # never loaded: its source is newer
    os.utime(build, (1, 1))
    finder = _fresh.FreshSource()
    monkeypatch.setattr(_fresh, "_stale", ["said once already"])  # (the warning: below)
    spec = finder.find_spec("kvmesh.twin.mod", [str(pkg)])
    assert spec is not None and spec.origin == str(source)
    assert _fresh._stale[-1] == "kvmesh.twin.mod"
    os.utime(build, None)  # the build newer than its source: the build is what Python finds
    os.utime(source, (1, 1))
    spec = finder.find_spec("kvmesh.twin.mod", [str(pkg)])
    assert spec is not None and spec.origin == str(build)
    with pytest.warns(UserWarning, match="newer than its compiled build"):
        monkeypatch.setattr(_fresh, "_stale", [])
        os.utime(source, None)
        finder.find_spec("kvmesh.twin.mod", [str(pkg)])
