"""Plugin parameters as an EndpointPickerConfig gives them, checked against those the plugin
type declares (router.plugins.registry)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.protocol.wording import noun_for


def with_defaults(what: str, given: Any, declared: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a factory reads: those given, over the declared defaults. A parameter the
    type does not declare (a misspelt `matchThreshold`, say) is refused, not ignored."""
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise ValueError(f"{what}: parameters must be a mapping, got {type(given).__name__}")
    unknown = sorted(set(given) - set(declared))
    if unknown:
        known = ", ".join(sorted(declared)) or "none"
        names = f"{noun_for(len(unknown), 'parameter')} {', '.join(unknown)}"
        raise ValueError(f"{what}: unknown {names}; known: {known}")
    return {**declared, **given}
