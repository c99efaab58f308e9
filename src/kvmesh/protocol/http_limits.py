"""Limits on what a client may send over HTTP, shared by the router's front door and the engine's
HTTP server so both refuse the same requests in the same way."""

from __future__ import annotations

REQUEST_READ_TIMEOUT_S = 30.0  # a request's head and body arrive in full within this, else 408
IDLE_TIMEOUT_S = 75.0  # a connection with no request in progress closes after about this
MAX_HEADER_LINES = 100  # header (and trailer) lines per request, else 431
HEAD_TOO_LARGE = "Request header fields too large."
COMPRESSED_BODY = (
    "Compressed request bodies (Content-Encoding) are not supported: send the body as is."
)
UNSUPPORTED_TRANSFER_CODING = "Unsupported Transfer-Encoding: only chunked is accepted."
