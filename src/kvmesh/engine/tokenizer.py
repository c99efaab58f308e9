"""The engine's tokenizer functions live in kvmesh.protocol.tokenizer (shared with the router);
these names stay importable from here for the commands, the simulator and older callers."""

from __future__ import annotations

from kvmesh.protocol.tokenizer import (
    DEFAULT_GGUF,
    DEFAULT_MODEL_NAME,
    PROBES,
    default_gguf_path,
    encode,
    encode_off_loop,
    load_gguf_tokenizer,
    load_tokenizer,
    min_tokens,
    rust_backend,
    token_span,
)

__all__ = [
    "DEFAULT_GGUF",
    "DEFAULT_MODEL_NAME",
    "PROBES",
    "default_gguf_path",
    "encode",
    "encode_off_loop",
    "load_gguf_tokenizer",
    "load_tokenizer",
    "min_tokens",
    "rust_backend",
    "token_span",
]
