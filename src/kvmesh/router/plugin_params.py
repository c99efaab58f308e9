"""Plugin parameters as an EndpointPickerConfig gives them, checked for names nobody reads."""

from __future__ import annotations


class ReadParameters(dict):
    """A plugin's parameters that remember which keys its factory asked for, so that a
    parameter nobody reads (a misspelt `matchThreshold`, say) is refused, not ignored."""

    def __init__(self, params: dict | None) -> None:
        super().__init__(params or {})
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def refuse_unread(self, what: str) -> None:
        unread = sorted(set(self) - self.read)
        if unread:
            known = ", ".join(sorted(self.read)) or "none"
            raise ValueError(f"{what}: unknown parameter(s) {', '.join(unread)}; known: {known}")
