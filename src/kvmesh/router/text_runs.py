"""Where a prompt text's cached encoding is found: the router tokenizer's *runs* (encoded texts,
router.tokens), kept in an LRU and, for finding, in the order of their texts. Of all the texts
kept, the one sharing the longest prefix with a given text sorts next to it (on one side or the
other), so ``RunStore.find`` is a binary search of the sorted texts and a compare with each
neighbour: C-level string compares, no fingerprint of the text's prefixes and nothing that can
collide. The tokenizer encodes what follows the agreed prefix and ``add``s the new run, which is
kept once the request is on its way (``settle``; every ``find`` settles first, so no caller can
tell).

Not thread-safe: one thread at a time (router.request_parser holds it).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvmesh.router.compiled import bytelevel


def first_difference(a: array, b: array) -> int:
    """The index of the first item where arrays ``a`` and ``b`` (one type) differ, or the
    shorter's length: the lowest byte of their XOR read as little-endian integers is in that
    item, whatever the machine's byte order within an item (C-level, no loop per item)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = int.from_bytes(a[:n].tobytes(), "little") ^ int.from_bytes(b[:n].tobytes(), "little")
    return ((x & -x).bit_length() - 1) // 8 // a.itemsize  # its lowest set bit's byte, item


def common_prefix_py(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share: one compare when the shorter is a
    prefix of the longer (an agent's next turn), else a binary search of C-level compares.
    The twin of router._bytelevel's (a memcmp a block at a time), which ``common_prefix`` is
    where it was built."""
    if len(a) > len(b):
        a, b = b, a
    if b.startswith(a):
        return len(a)
    lo, hi = 0, len(a) - 1  # invariant: a[:lo] == b[:lo], and they differ before index hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


_compiled = bytelevel()
common_prefix = _compiled.common_prefix if _compiled is not None else common_prefix_py


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


class Run:
    """One cached encoding of ``text``.

    Invariants: ``cut_chars``/``cut_tokens`` ascend from (0, 0), and ``ids[:cut_tokens[i]]`` is
    both the encoding of ``text[:cut_chars[i]]`` and a prefix of the whole text's encoding.
    ``keys``/``chain``: the block keys and digests of the full blocks of ``pre + ids`` (no
    salt), once a prompt asked for them.
    """

    __slots__ = ("text", "ids", "cut_chars", "cut_tokens", "pre", "keys", "chain")

    def __init__(self, text: str, ids: Sequence[int], cuts: tuple[Any, Any]) -> None:
        self.text = text
        self.ids = ids if isinstance(ids, array) else array("I", ids)
        chars, tokens = cuts
        self.cut_chars = chars if isinstance(chars, array) else array("Q", chars)
        self.cut_tokens = tokens if isinstance(tokens, array) else array("Q", tokens)
        self.pre: list[int] | None = None  # the special ids the keys were made with
        self.keys: list[int] = []
        self.chain: list[bytes] = []


class Found(NamedTuple):
    """What the store knows of a text: ``exact``, the run of this very text (else None); else
    ``run``, the one agreeing longest (None: none), for ``agree`` characters, and whether the
    text ``extends`` all of it (an agent's next turn: the run becomes redundant)."""

    exact: Run | None
    run: Run | None
    agree: int
    extends: bool


class RunStore:
    """Invariants: ``texts`` is sorted and ``ordered[i].text == texts[i]``, over exactly the
    runs of ``runs`` (an LRU, oldest first; no two with one text); ``tokens`` is the ids held
    over them, at most ``max_tokens`` and at most ``max_runs`` runs after each settle (beyond
    one run)."""

    def __init__(self, max_runs: int, max_tokens: int) -> None:
        self.max_runs, self.max_tokens = max_runs, max_tokens
        self.runs: OrderedDict[Run, None] = OrderedDict()
        self.texts: list[str] = []
        self.ordered: list[Run] = []
        self.tokens = 0
        self._added: list[tuple[Run, Run | None]] = []  # not yet applied

    def find(self, text: str) -> Found:
        if self._added:
            self.settle()
        texts = self.texts
        i = bisect_left(texts, text)
        if i < len(texts) and texts[i] == text:
            run = self.ordered[i]
            self.runs.move_to_end(run)
            return Found(run, run, len(text), False)
        run, agree = None, 0
        for j in (i - 1, i):  # the neighbours: one of them shares the longest prefix
            if 0 <= j < len(texts):
                n = common_prefix(texts[j], text)
                if n > agree:
                    run, agree = self.ordered[j], n
        extends = run is not None and agree == len(run.text)
        return Found(None, run, agree, extends)

    def add(self, run: Run, found: Found) -> None:
        """Keep `run`, the encoding of the text `found` was found for, from the next settle."""
        self._added.append((run, found.run if found.extends else None))

    def settle(self) -> None:
        added, self._added = self._added, []
        for run, superseded in added:
            if superseded is not None:
                self.drop(superseded)
            self._insert(run)
            while len(self.runs) > 1 and (
                len(self.runs) > self.max_runs or self.tokens > self.max_tokens
            ):
                self.drop(next(iter(self.runs)))

    def forget_keys(self) -> None:
        """The runs' block keys were made of blocks of another size: drop them."""
        if self._added:
            self.settle()
        for run in self.runs:
            run.pre, run.keys, run.chain = None, [], []

    def drop(self, run: Run) -> None:
        if run not in self.runs:
            return
        del self.runs[run]
        self.tokens -= len(run.ids)
        i = bisect_left(self.texts, run.text)
        del self.texts[i], self.ordered[i]

    def _insert(self, run: Run) -> None:
        i = bisect_left(self.texts, run.text)
        if i < len(self.texts) and self.texts[i] == run.text:  # (a run of this text: replaced)
            self.drop(self.ordered[i])
        self.texts.insert(i, run.text)
        self.ordered.insert(i, run)
        self.runs[run] = None
        self.tokens += len(run.ids)
