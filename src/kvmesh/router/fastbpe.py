"""Byte-level BPE encoding with a per-word cache, for the router's hot path.

A GPT-2-style tokenizer (no normalizer, the ByteLevel pre-tokenizer with its regex, a BPE model
without dropout, added tokens matched as whole strings) encodes a text as the concatenation of
the BPE of each pre-token. Pre-tokens repeat (words), so their ids are cached: a prompt costs one
C-level regex pass and a dict lookup per word, about a fifth of the Rust tokenizer's time, whose
pre-tokenizer dominates. ``FastBPE.probe`` accepts a tokenizer only when its structure is that
and its ids agree with the Rust tokenizer's on a varied corpus; otherwise the router keeps the
Rust tokenizer.

An ASCII text of up to ``SCAN_CHARS`` characters is encoded by router._bytelevel, a compiled
scan that splits, looks its words up and places the cuts in one pass, where that module was
built (setup.py); this module's Python path is its twin, held equal by the tests, and the path
of every other text (a longer one is split by ``regex`` without the GIL, so a thread encoding it
lets the event loop run).
"""

from __future__ import annotations

import json
import re
import unicodedata
from bisect import bisect_left
from functools import cache
from itertools import accumulate, chain
from typing import Any

import regex

from kvmesh.router.compiled import bytelevel

_compiled = bytelevel()
AsciiScanner = _compiled.AsciiScanner if _compiled is not None else None  # None: the Python path

SCAN_CHARS = 65_536  # the longest text the compiled scan takes (it holds the GIL throughout)

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same split of an ASCII text, for the standard library's smaller engine (2-3x faster, and
# cheaper to come back to cold): over ASCII, \p{L} is [A-Za-z], \p{N} is [0-9], and \s is the
# Unicode White_Space property's [\t\n\v\f\r ] (not str.isspace, which adds \x1c-\x1f)
_WS = r"[\t\n\x0b\x0c\r ]"
ASCII_SPLIT = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\t\n\x0b\x0c\r A-Za-z0-9]+"
    rf"|{_WS}+(?![^\t\n\x0b\x0c\r ])|{_WS}+"
)
PROBES = (
    "Hello world, it's 2024! Don't   panic:\n\n\tcode = f(x) + 42 * y;\r\n",
    "déjà vu 😀 naïve café — «quotes» “smart” 東京タワー 한국어 Ελληνικά עברית العربية",
    "   leading and trailing spaces   \n  \n\n\n    indented\tline  ",
    "numbers 1234567890 3.14159 -0.5e10 0x1F $100,000.00 50% #hash @at ~tilde",
    "I'M HE'S we'll you'd they've she'd 'quoted' O'Brien rock'n'roll",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|><|endoftext|>x<|im_start|><|im_end|>  <|im_start|> y",
    "def f(a, b):\n    return {'k': [a, b]}  # comment\n\n\nclass X:\n\tpass\n",
    "\u00a0nbsp\u2009thin\u3000ideographic\u200bzero-width\ufeffbom",
    "mixed123abc ABC123 a1b2c3 __init__ --flag=value path/to/file.py https://x.y/z?q=1",
)


class Declined(UnicodeError):
    """A text this encoder may not split as the Rust tokenizer does: the Rust path encodes it.
    (A lone surrogate declines as a UnicodeEncodeError, also a UnicodeError.)"""


@cache
def newer_letters() -> re.Pattern[str] | None:
    """The letters and digits ``regex``'s Unicode tables know and Python's (the oldest of the
    three here, with the Rust tokenizer's) do not: a character assigned since may be a letter
    to ``regex`` and unassigned, so punctuation, to the Rust tokenizer, and split otherwise. A
    text holding one is left to the Rust path. Found once, in about 0.1 s."""
    every = "".join(map(chr, range(0x80, 0xD800))) + "".join(map(chr, range(0xE000, 0x110000)))
    found = [c for c in regex.findall(r"[\p{L}\p{N}]", every) if unicodedata.category(c) == "Cn"]
    if not found:
        return None
    return re.compile("[" + "".join(re.escape(c) for c in found) + "]")


def _byte_chars() -> str:
    """The ByteLevel alphabet: byte b -> one printable char (GPT-2's table), as 256 chars."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in range(256))


class FastBPE:
    def __init__(
        self, model: Any, added: dict[str, int], max_words: int = 500_000, compiled: bool = True
    ) -> None:
        self.model = model
        self.split = regex.compile(GPT2_SPLIT)
        self.ascii_split = re.compile(ASCII_SPLIT)
        names = sorted(added, key=len, reverse=True)  # longest first: leftmost-longest match
        self.added = added
        self.openers = frozenset(name[0] for name in names)  # no such char: no added token
        self.specials = (
            regex.compile("(" + "|".join(map(regex.escape, names)) + ")") if names else None
        )
        self.to_chars = {i: c for i, c in enumerate(_byte_chars())}
        self.words: dict[str, list[int]] = {}
        self.max_words = max_words
        # the compiled scan, when built and wanted (compiled=False: the Python twin, for tests)
        self.scan = None
        if compiled and AsciiScanner is not None:
            by_length = [(name, added[name]) for name in names]
            self.scan = AsciiScanner(self.words, self._word, by_length).encode

    @classmethod
    def probe(cls, backend: Any) -> FastBPE | None:
        """A FastBPE for this Rust tokenizer, or None when it is not plain byte-level BPE or
        disagrees with it on the probe corpus."""
        try:
            spec = json.loads(backend.to_str())
            pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
            plain = (
                spec.get("normalizer") is None
                and pre.get("type") == "ByteLevel"
                and pre.get("use_regex", True)
                and not pre.get("add_prefix_space", False)
                and model.get("type") == "BPE"
                and not model.get("dropout")
            )
            added = spec.get("added_tokens") or []
            if not plain or any(
                t.get(k) for t in added for k in ("lstrip", "rstrip", "single_word")
            ):
                return None
            fast = cls(backend.model, {t["content"]: t["id"] for t in added})
            for text in (*PROBES, "".join(PROBES), " ".join(PROBES[::-1])):
                if fast.encode(text) != backend.encode(text, add_special_tokens=False).ids:
                    return None
        except Exception:  # an unexpected tokenizer layout: keep the Rust path
            return None
        return fast

    def _word(self, word: str) -> list[int]:
        ids = self.words.get(word)
        if ids is None:
            chars = word.encode("utf-8").decode("latin-1").translate(self.to_chars)
            ids = [t.id for t in self.model.tokenize(chars)]
            if len(self.words) >= self.max_words:
                self.words.clear()
            self.words[word] = ids
        return ids

    def _findall(self, text: str) -> list[str]:
        if len(text) <= 4096 and text.isascii():  # (isascii is O(1): CPython keeps it)
            return self.ascii_split.findall(text)
        # a long text is split without the GIL, so a thread tokenizing it lets the loop run
        return self.split.findall(text, concurrent=len(text) > 4096 or None)

    def pieces(self, text: str) -> tuple[list[str], list[list[int]]]:
        """The pre-tokens and added tokens of text, in order, and the ids of each."""
        if not text.isascii() and (newer := newer_letters()) and newer.search(text):
            raise Declined("a character newer than Python's Unicode tables")
        words, word, split = self.words, self._word, self._findall
        if self.specials is None or not any(c in text for c in self.openers):
            pieces = split(text)
            ids = list(map(words.get, pieces))  # (C-level: most pieces are cached words)
            k = 0
            while True:  # the words not cached yet
                try:
                    k = ids.index(None, k)
                except ValueError:
                    break
                ids[k] = word(pieces[k])
            return pieces, ids
        pieces, ids = [], []
        for k, part in enumerate(self.specials.split(text)):
            if k % 2:
                pieces.append(part)
                ids.append([self.added[part]])
            elif part:
                found = split(part)
                pieces += found
                ids += [words.get(w) or word(w) for w in found]
        return pieces, ids

    def _scans(self, text: str) -> bool:
        return self.scan is not None and text.isascii() and len(text) <= SCAN_CHARS

    def encode(self, text: str) -> list[int]:
        if self._scans(text):
            return self.scan(text, 0, 0, 0)[0]
        return list(chain.from_iterable(self.pieces(text)[1]))

    def encode_with_cuts(
        self, text: str, base_char: int, base_tok: int, stride: int
    ) -> tuple[list[int], tuple[list[int], list[int]]]:
        """Ids of text and cuts after pieces about every ``stride`` tokens: the ids before a
        cut are the encoding of the text before it."""
        if self._scans(text):
            return self.scan(text, stride, base_char, base_tok)
        pieces, piece_ids = self.pieces(text)
        ids = list(chain.from_iterable(piece_ids))
        tok_end = list(accumulate(map(len, piece_ids)))
        char_end = list(accumulate(map(len, pieces)))
        cut_chars: list[int] = []
        cut_tokens: list[int] = []
        last, target = len(pieces) - 1, stride
        while target < len(ids):
            i = bisect_left(tok_end, target)
            while i < last and pieces[i].isspace():
                i += 1  # never after whitespace: how a run splits depends on what follows
            if i >= last:
                break
            cut_chars.append(base_char + char_end[i])
            cut_tokens.append(base_tok + tok_end[i])
            target = tok_end[i] + stride
        return ids, (cut_chars, cut_tokens)
