"""The chunked transfer coding as the router's proxy reads an engine's answer: only where the
body ends; its bytes pass on as they came, never re-encoded."""

from __future__ import annotations


class ChunkTracker:
    """Where a chunked body ends, found without copying it. ``need``: chunk bytes plus their
    CRLF still to pass; ``line``: a size (or trailer) line in progress; ``tail``: after the
    last chunk, reading trailers."""

    __slots__ = ("need", "line", "tail")

    def __init__(self) -> None:
        self.need, self.line, self.tail = 0, b"", False

    @property
    def at_boundary(self) -> bool:
        return self.need == 0 and not self.line and not self.tail

    def feed(self, data: bytes) -> int:
        """Offset just past the body's end within data, or -1 when it goes on."""
        i, n = 0, len(data)
        while i < n:
            if self.need:
                take = min(self.need, n - i)
                self.need -= take
                i += take
                continue
            eol = data.find(b"\n", i)
            if eol < 0:
                self.line += data[i:]
                return -1
            line, self.line = (self.line + data[i:eol]).rstrip(b"\r"), b""
            i = eol + 1
            if self.tail:
                if not line:
                    return i
            else:
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size:
                    self.need = size + 2
                else:
                    self.tail = True
        return -1
