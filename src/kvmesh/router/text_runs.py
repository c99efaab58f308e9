"""Where a prompt text's cached encoding is found: the router tokenizer's *runs* (encoded texts,
router.tokens), kept in an LRU and found through fingerprints of text prefixes (xxh3-128,
seeded per process: a fingerprint, not a security boundary; a collision could only mis-key a
routing hint, engines tokenize on their own, and the seed keeps collisions from being crafted).

Coarse fingerprints every ``16 * chunk`` characters cover the whole text, fine ones every
``chunk`` characters follow the coarse agreement point (where an extended text diverges).
``RunStore.find`` names the run that agrees longest with a text and for how many characters;
the tokenizer encodes what follows and ``add``s the new run, which is kept once the request is
on its way (``settle``; every ``find`` settles first, so no caller can tell).

Not thread-safe: one thread at a time (router.request_parser holds it).
"""

from __future__ import annotations

import secrets
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import xxhash

COARSE = 16  # fine chunks per coarse chunk


def utf8(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def first_difference(a: array, b: array) -> int:
    """The index of the first item where arrays ``a`` and ``b`` (one type) differ, or the
    shorter's length: the lowest byte of their XOR read as little-endian integers is in that
    item, whatever the machine's byte order within an item (C-level, no loop per item)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = int.from_bytes(a[:n].tobytes(), "little") ^ int.from_bytes(b[:n].tobytes(), "little")
    return ((x & -x).bit_length() - 1) // 8 // a.itemsize  # its lowest set bit's byte, item


def offset_cuts(
    offsets: Sequence[tuple[int, int]], stride: int, base_char: int, base_tok: int
) -> tuple[list[int], list[int]]:
    """Cuts about every ``stride`` tokens of a tokenization from its tokens' character offsets,
    shifted by the bases: (cut characters, cut tokens). A cut before token u is clean when u
    starts exactly where u-1 ends (tokens holding parts of one character overlap; trimmed
    offsets leave gaps)."""
    cut_chars: list[int] = []
    cut_tokens: list[int] = []
    n = len(offsets)
    for t in range(stride, n, stride):
        for u in range(t, min(t + stride // 2, n)):
            end = offsets[u - 1][1]
            if end == offsets[u][0] and end > 0:
                cut_chars.append(base_char + end)
                cut_tokens.append(base_tok + u)
                break
    return cut_chars, cut_tokens


def _common(text: str, start: int, tail: str) -> int:
    """How many leading characters of ``tail`` ``text`` repeats from ``start``: for ASCII (a
    byte per character) the first_difference of their bytes; else a binary search of C-level
    compares (a tail is shorter than a fine chunk)."""
    n = min(len(tail), len(text) - start)
    a, b = text[start : start + n], tail[:n]
    if a == b:
        return n
    if a.isascii() and b.isascii():
        return first_difference(array("B", a.encode()), array("B", b.encode()))
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(tail[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class Run:
    """One cached encoding of a text of ``length`` chars.

    Invariants: ``cut_chars``/``cut_tokens`` ascend from (0, 0), and ``ids[:cut_tokens[i]]`` is
    both the encoding of ``text[:cut_chars[i]]`` and a prefix of the whole text's encoding.
    ``tail`` is the text after its last fine checkpoint; ``digests`` lists every checkpoint it
    registered (some may since lead to newer runs). ``keys``/``chain``: the block keys and
    digests of the full blocks of ``pre + ids`` (no salt), once a prompt asked for them.
    """

    __slots__ = (
        "length",
        "tail",
        "ids",
        "cut_chars",
        "cut_tokens",
        "digests",
        "pre",
        "keys",
        "chain",
    )

    def __init__(self, text: str, chunk: int, ids: Sequence[int], cuts: tuple[Any, Any]) -> None:
        self.length = len(text)
        self.tail = text[len(text) - len(text) % chunk :]
        self.ids = ids if isinstance(ids, array) else array("I", ids)
        chars, tokens = cuts
        self.cut_chars = chars if isinstance(chars, array) else array("Q", chars)
        self.cut_tokens = tokens if isinstance(tokens, array) else array("Q", tokens)
        self.digests: list[bytes] = []
        self.pre: list[int] | None = None  # the special ids the keys were made with
        self.keys: list[int] = []
        self.chain: list[bytes] = []


class Found(NamedTuple):
    """What the store knows of a text: ``exact``, the run of this very text (else None); else
    ``run``, the one agreeing longest (None: none), for ``agree`` characters, and whether the
    text ``extends`` all of it (an agent's next turn: the run becomes redundant);
    ``digests``: the text's checkpoints, for ``add``."""

    exact: Run | None
    run: Run | None
    agree: int
    extends: bool
    digests: list[bytes]


class RunStore:
    """Invariants: ``ckpt`` maps a checkpoint to a run in ``runs`` holding it (or to a run
    being added); ``tokens`` is the ids held over ``runs``, at most ``max_tokens`` and at most
    ``max_runs`` runs after each settle (beyond one run)."""

    def __init__(self, chunk: int, max_runs: int, max_tokens: int) -> None:
        self.chunk, self.max_runs, self.max_tokens = chunk, max_runs, max_tokens
        self.runs: OrderedDict[Run, None] = OrderedDict()  # LRU, oldest first
        self.ckpt: dict[bytes, Run] = {}  # fingerprint of a text prefix -> a run extending it
        self.tokens = 0
        self._seed = secrets.randbits(64)
        self._added: list[tuple[Run, list[bytes], Run | None]] = []  # not yet applied

    def find(self, text: str) -> Found:
        if self._added:
            self.settle()
        ckpt, fine_size = self.ckpt, self.chunk
        raw = memoryview(text.encode()) if text.isascii() else None  # a byte per character
        coarse, states, final = self._coarse(text, raw)
        run = ckpt.get(final)
        if run is not None and run.length == len(text):  # equal digests: equal texts
            self.runs.move_to_end(run)
            return Found(run, run, len(text), False, [])
        k = len(coarse)
        while k and coarse[k - 1] not in ckpt:
            k -= 1
        start = k * fine_size * COARSE
        fine, h = [], states[k]  # fine[i]: digest of text[:start + (i+1)*chunk]
        for a in range(start, len(text) - fine_size + 1, fine_size):
            h.update(raw[a : a + fine_size] if raw is not None else utf8(text[a : a + fine_size]))
            fine.append(h.digest())
        run, agree = (ckpt[coarse[k - 1]], start) if k else (None, 0)
        for i in range(len(fine) - 1, -1, -1):
            if fine[i] in ckpt:
                run, agree = ckpt[fine[i]], start + (i + 1) * fine_size
                break
        extends = False
        if run is not None:
            aligned = run.length - len(run.tail)
            if agree >= aligned:  # it agrees with all the run's checkpoints: read on in its tail
                extends = text.startswith(run.tail, aligned)
                agree = run.length if extends else aligned + _common(text, aligned, run.tail)
        return Found(None, run, agree, extends, [*coarse, *fine, final])

    def add(self, run: Run, found: Found) -> None:
        """Keep `run`, the encoding of the text `found` was found for, from the next settle."""
        self._added.append((run, found.digests, found.run if found.extends else None))

    def settle(self) -> None:
        added, self._added = self._added, []
        for run, digests, superseded in added:
            self._replace(run, digests, superseded)

    def forget_keys(self) -> None:
        """The runs' block keys were made of blocks of another size: drop them."""
        if self._added:
            self.settle()
        for run in self.runs:
            run.pre, run.keys, run.chain = None, [], []

    def _coarse(self, text: str, raw: memoryview | None) -> tuple[list[bytes], list[Any], bytes]:
        """Digests of text[:k*coarse] for k = 1.., the hasher state at each k (k = 0 too), and
        the digest of the whole text (``raw``: the text's bytes, when one per character)."""
        size = self.chunk * COARSE
        h = xxhash.xxh3_128(seed=self._seed)
        out, states = [], [h.copy()]
        whole = len(text) - len(text) % size
        for a in range(0, whole, size):
            h.update(raw[a : a + size] if raw is not None else utf8(text[a : a + size]))
            out.append(h.digest())
            states.append(h.copy())
        h.update(raw[whole:] if raw is not None else utf8(text[whole:]))
        return out, states, h.digest()

    def _replace(self, run: Run, digests: list[bytes], superseded: Run | None) -> None:
        """Remember run in place of `superseded` (None: none): the checkpoints both share
        are pointed at the new run, not deleted and added again."""
        if superseded is not None and superseded in self.runs:
            del self.runs[superseded]
            self.tokens -= len(superseded.ids)
        run.digests = digests
        self.ckpt.update(dict.fromkeys(digests, run))
        self.runs[run] = None
        self.tokens += len(run.ids)
        while len(self.runs) > 1 and (
            len(self.runs) > self.max_runs or self.tokens > self.max_tokens
        ):
            self.drop(next(iter(self.runs)))
        if superseded is not None:
            self._unlink(superseded)

    def drop(self, run: Run) -> None:
        if run in self.runs:
            del self.runs[run]
            self.tokens -= len(run.ids)
        self._unlink(run)

    def _unlink(self, run: Run) -> None:
        ckpt = self.ckpt
        for d in run.digests:
            if ckpt.get(d) is run:
                del ckpt[d]
