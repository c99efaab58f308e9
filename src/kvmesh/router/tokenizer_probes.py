"""What a tokenizer can be trusted to do, checked on probe texts before the prompt tokenizer
relies on it: a faster backend with the same ids and offsets, offsets that agree with encode,
and fixed special tokens around any text."""

from __future__ import annotations

from typing import Any

from kvmesh.engine.tokenizer import PROBES, rust_backend

_PROBES = ("a", "hello world", "x = 1\n")


def fast_backend(tokenizer: Any) -> Any:
    """The engine's verified Rust backend (same ids, same text), whose offsets also agree
    with the wrapper's, as the tail cache cuts texts by them."""
    backend = rust_backend(tokenizer)
    if backend is None:
        return None
    for p in PROBES:
        enc = backend.encode(p, add_special_tokens=False)
        ref = tokenizer(p, add_special_tokens=False, return_offsets_mapping=True)
        if [tuple(o) for o in ref["offset_mapping"]] != list(enc.offsets):
            return None
    return backend


def offsets_work(tokenizer: Any) -> bool:
    """Whether tokenizer(text, return_offsets_mapping=True) exists and agrees with encode."""
    try:
        for p in _PROBES:
            enc = tokenizer(p, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            if ids != tokenizer.encode(p, add_special_tokens=False):
                return False
            if len(enc["offset_mapping"]) != len(ids):
                return False
    except Exception:  # slow tokenizers raise NotImplementedError; others may differ
        return False
    return True


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """(prefix, suffix) ids that add_special_tokens=True puts around any text, if fixed."""
    found = set()
    for p in _PROBES:
        bare = tokenizer.encode(p, add_special_tokens=False)
        full = tokenizer.encode(p, add_special_tokens=True)
        at = [i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare]
        if len(at) != 1 or not bare:
            return None
        found.add((tuple(full[: at[0]]), tuple(full[at[0] + len(bare) :])))
    if len(found) != 1:
        return None
    pre, post = found.pop()
    return list(pre), list(post)
