"""The router's compiled part, router/_bytelevel.pyx: its module, or None where it was not built
(no C compiler at install) or ``KVMESH_PURE_PYTHON=1`` asks for the pure-Python twins, which the
tests hold equal to it (tests/test_router_bytelevel.py)."""

from __future__ import annotations

import os
from types import ModuleType


def bytelevel() -> ModuleType | None:
    if os.environ.get("KVMESH_PURE_PYTHON", "") not in ("", "0"):  # the twins on purpose
        return None
    try:
        from kvmesh.router import _bytelevel
    except ImportError:  # not built: the Python twins do it all
        return None
    return _bytelevel
