"""The compiled request path: a module compiled by `kvmesh native build` loads compiled only while
its source is the one it was built from, KVMESH_NATIVE=0 turns it off, and in a built checkout
every router and protocol module loads compiled."""

from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import json
import sys
from pathlib import Path

import pytest

from kvmesh import native
from kvmesh.commands import native as native_cmd

SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)

PROBE = """
from __future__ import annotations
from dataclasses import dataclass


@dataclass(slots=True)
class Pair:
    a: int
    b: list[int]


async def total(pair: Pair) -> int:
    return pair.a + sum(pair.b)


def answer() -> str:
    return "VERSION"
"""


def _forget(package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A package `kvprobe` with one module in a `router` subpackage, on sys.path."""
    pytest.importorskip("Cython")
    src = tmp_path / "src"
    (src / "kvprobe" / "router").mkdir(parents=True)
    (src / "kvprobe" / "__init__.py").write_text("")
    (src / "kvprobe" / "router" / "__init__.py").write_text("")
    (src / "kvprobe" / "router" / "mod.py").write_text(PROBE.replace("VERSION", "built"))
    monkeypatch.syspath_prepend(str(src))
    yield src / "kvprobe"
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "prefix", None) != "kvprobe."]
    _forget("kvprobe")


def _load(root: Path, manifest: Path):
    _forget("kvprobe")
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "prefix", None) != "kvprobe."]
    native.install_finder("kvprobe", manifest)
    return importlib.import_module("kvprobe.router.mod")


def test_a_module_loads_compiled_until_its_source_changes(probe, tmp_path, monkeypatch):
    manifest = tmp_path / "manifest.json"
    modules = native.sources(probe)
    assert list(modules) == ["kvprobe.router.mod"]
    native_cmd.build(modules, manifest, 1, tmp_path / "work")
    assert json.loads(manifest.read_text())["modules"] == {
        "kvprobe.router.mod": native.digest(modules["kvprobe.router.mod"])
    }

    mod = _load(probe, manifest)
    assert mod.__file__.endswith(SUFFIXES)
    assert mod.answer() == "built"
    assert asyncio.run(mod.total(mod.Pair(1, [2, 3]))) == 6  # same behaviour as its source
    assert native.status(probe, manifest).compiled == ["kvprobe.router.mod"]

    monkeypatch.setenv("KVMESH_NATIVE", "0")  # turned off: the source runs
    mod = _load(probe, manifest)
    assert mod.__file__.endswith(".py") and mod.answer() == "built"
    assert native.status(probe, manifest).stale == ["kvprobe.router.mod"]
    monkeypatch.delenv("KVMESH_NATIVE")

    modules["kvprobe.router.mod"].write_text(PROBE.replace("VERSION", "edited"))
    mod = _load(probe, manifest)  # edited since the build: what the file says now runs
    assert mod.__file__.endswith(".py") and mod.answer() == "edited"
    assert native.status(probe, manifest).stale == ["kvprobe.router.mod"]

    manifest.unlink()  # an extension module with no manifest is never trusted
    mod = _load(probe, manifest)
    assert mod.__file__.endswith(".py")
    assert native.status(probe, manifest).missing == ["kvprobe.router.mod"]


def test_a_built_checkout_loads_its_request_path_compiled():
    """`make install` builds the request path; where it was built (or could have been: Cython
    is installed) every router and protocol module must load compiled."""
    try:
        import Cython  # noqa: F401
    except ImportError:
        if not native.MANIFEST.exists():
            pytest.skip("no compiled request path here, and no Cython to build one")
    assert native.MANIFEST.exists(), "no build: run `kvmesh native build` (make install runs it)"
    s = native.status()
    if s.stale:
        pytest.skip(f"edited since the build (run make native): {', '.join(s.stale)}")
    assert not s.missing, s.missing
    for name in s.compiled:
        assert importlib.import_module(name).__file__.endswith(SUFFIXES), name
    assert native.summary().startswith("request path: compiled")


def test_a_built_checkout_runs_the_presets_profiles_compiled():
    """`kvmesh native build` compiles the built-in presets' joined profiles; a pipeline built
    from a preset then runs the compiled function of exactly its profile's source."""
    from types import SimpleNamespace

    from kvmesh.router.pipeline import Pipeline

    if "kvmesh.router.plugins.joined_profiles" not in native.status().compiled:
        pytest.skip("the joined profiles are not compiled here")
    from kvmesh.router.plugins import joined_profiles

    assert joined_profiles.__file__.endswith(SUFFIXES)
    ctx = SimpleNamespace(precise_index=None, approximate_index=None)
    for preset in ("kvmesh", "precise-prefix", "pd"):
        for profile in Pipeline.preset(preset, ctx).profiles.values():
            if profile.scorers:
                for run in (profile.totals, profile.explained):
                    assert run.__module__ == "kvmesh.router.plugins.joined_profiles", preset
