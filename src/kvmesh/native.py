"""The router's compiled request path. Every module under ``kvmesh.router`` and
``kvmesh.protocol`` is compiled as it is written, by Cython, into an extension module beside its
source (``kvmesh native build``; ``make install`` runs it). No code changes for it:
annotations are not taken as C types, so a compiled module behaves as its source does, and the
whole test suite runs against the compiled modules. The router's Python work per request is
about a third less (README, "The compiled request path").

An extension module is imported only while its source is the one it was compiled from (the
SHA-256 in the build's manifest): an edited file runs as the Python it says until the next
build, and ``KVMESH_NATIVE=0`` runs every module from its source. Without a build (no C compiler,
no Cython) nothing changes: kvmesh is pure Python."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent  # the kvmesh package
PACKAGES = ("router", "protocol")
# module -> why it stays Python (Cython cannot compile it)
LEFT_OUT = {"kvmesh.router.k8s_discovery": "a starred exception tuple in an except clause"}
MANIFEST = ROOT / "_native.json"
DIRECTIVES = {"language_level": 3, "annotation_typing": False}
_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def sources(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """The modules compiled: ``{dotted name: source path}``, package ``__init__`` files not."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            rel = path.relative_to(root.parent).with_suffix("")
            name = ".".join(rel.parts)
            if name not in LEFT_OUT:
                out[name] = path
    return out


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FreshExtensions:
    """A meta-path finder for one package: its extension modules load only where the manifest
    names them with their source's current digest; any other extension module of the package
    (stale, or with no manifest at all) loads from the ``.py`` beside it."""

    def __init__(self, package: str, digests: dict[str, str]) -> None:
        self.prefix = package + "."
        self.digests = digests

    def find_spec(self, name: str, path=None, target=None):
        if not name.startswith(self.prefix):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not (spec.origin or "").endswith(_SUFFIXES):
            return spec
        source = Path(spec.origin).parent / (name.rpartition(".")[2] + ".py")
        if not source.exists():
            return spec
        if self.digests.get(name) == digest(source):
            return spec
        return importlib.util.spec_from_file_location(name, source)


def install_finder(package: str = "kvmesh", manifest: Path = MANIFEST) -> FreshExtensions:
    """Put the package's finder first on ``sys.meta_path`` (once); ``KVMESH_NATIVE=0``: no
    extension module of the package loads."""
    for finder in sys.meta_path:
        if isinstance(finder, FreshExtensions) and finder.prefix == package + ".":
            return finder
    digests: dict[str, str] = {}
    if os.environ.get("KVMESH_NATIVE", "1") != "0" and manifest.exists():
        try:
            digests = json.loads(manifest.read_text())["modules"]
        except (ValueError, KeyError, OSError):
            digests = {}
    finder = FreshExtensions(package, digests)
    sys.meta_path.insert(0, finder)
    return finder


class Status(NamedTuple):
    compiled: list[str]  # loaded (or would load) from their extension module
    stale: list[str]  # built from another version of their source: run as Python
    missing: list[str]  # never built


def status(root: Path = ROOT, manifest: Path = MANIFEST) -> Status:
    """Which of the compiled modules would load compiled now."""
    built = json.loads(manifest.read_text())["modules"] if manifest.exists() else {}
    off = os.environ.get("KVMESH_NATIVE", "1") == "0"
    compiled, stale, missing = [], [], []
    for name, path in sources(root).items():
        has_ext = any(path.with_name(path.stem + s).exists() for s in _SUFFIXES)
        if name not in built or not has_ext:
            missing.append(name)
        elif off or built[name] != digest(path):
            stale.append(name)
        else:
            compiled.append(name)
    return Status(compiled, stale, missing)


def summary() -> str:
    """One line for logs and benchmark reports."""
    s = status()
    total = len(s.compiled) + len(s.stale) + len(s.missing)
    if os.environ.get("KVMESH_NATIVE", "1") == "0":
        return f"request path: Python (KVMESH_NATIVE=0; {len(s.compiled) + len(s.stale)} built)"
    if not s.compiled:
        return "request path: Python (not compiled: kvmesh native build)"
    return f"request path: compiled ({len(s.compiled)} of {total} modules)" + (
        f", {len(s.stale)} edited since the build run as Python" if s.stale else ""
    )
