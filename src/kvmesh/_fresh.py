"""Compiled modules never shadow newer source. setup.py builds some modules of the request path
in place beside their .py (Cython, unchanged source); Python would import the build even after
the .py was edited. This finder, installed by kvmesh/__init__.py, loads the .py instead where it
is newer than its build (and says so once, naming `make install`), and for every compiled module
when KVMESH_PURE_PYTHON=1 (the pure-Python twin, as tests/test_compiled_twins.py runs it)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from types import ModuleType

PURE = os.environ.get("KVMESH_PURE_PYTHON", "") not in ("", "0")
_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
_stale: list[str] = []


class FreshSource(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path, target: ModuleType | None = None):
        if not name.startswith("kvmesh.") or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(_SUFFIXES):
            return spec
        stem = origin[: -len(next(s for s in _SUFFIXES if origin.endswith(s)))]
        source = stem + ".py"
        if not os.path.exists(source):  # a module with no .py (a .pyx): it has its own twin
            if PURE:
                raise ModuleNotFoundError(f"{name}: KVMESH_PURE_PYTHON=1", name=name)
            return spec
        if not PURE and os.path.getmtime(source) <= os.path.getmtime(origin):
            return spec
        if not PURE and not _stale:
            warnings.warn(
                f"{source} is newer than its compiled build: running it as Python (slower); "
                "`make install` rebuilds",
                stacklevel=2,
            )
        _stale.append(name)
        return importlib.util.spec_from_file_location(name, source)


def install() -> None:
    if not any(isinstance(f, FreshSource) for f in sys.meta_path):
        sys.meta_path.insert(0, FreshSource())
