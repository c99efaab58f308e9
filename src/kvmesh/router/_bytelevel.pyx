# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled twins of the router's scans over a text's bytes: text_runs.common_prefix, and
router.fastbpe's encoding of an ASCII text: GPT-2's pre-tokenizer split
(``fastbpe.ASCII_SPLIT``, the regex's alternatives in order) written as a scan of the text's
bytes, each piece's ids read from the word cache in the same pass, and the cuts chosen as
``FastBPE.encode_with_cuts`` chooses them. tests/test_router_bytelevel.py holds it equal to the
Python path (and both to the Rust tokenizer) on generated texts; router.fastbpe falls back to
the Python path where this module was not built.

The split, at each piece start ``i`` (``ws`` is ``[\\t\\n\\v\\f\\r ]``):
  1. ``'s 't 're 've 'm 'll 'd``;
  2.-4. an optional space, then a run of one class: letters, digits, or the rest (not ``ws``);
  5. a ``ws`` run up to the end of the text, or up to one ``ws`` before a non-``ws``;
  6. a single ``ws``.
Added tokens (``specials``, longest first) are matched as whole strings at the leftmost place
any starts, and the text between them is split alone.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.unicode cimport PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_KIND, PyUnicode_READ
from libc.string cimport memcmp, memset

cdef enum:
    LETTER = 1
    DIGIT = 2
    OTHER = 3
    SPACE = 4

cdef unsigned char CLASS[256]
cdef unsigned char ISSPACE[256]  # str.isspace of one byte: ws and \x1c-\x1f
cdef int _b
for _b in range(256):
    CLASS[_b] = OTHER
    ISSPACE[_b] = chr(_b).isspace() and _b < 128
for _b in range(ord("a"), ord("z") + 1):
    CLASS[_b] = LETTER
for _b in range(ord("A"), ord("Z") + 1):
    CLASS[_b] = LETTER
for _b in range(ord("0"), ord("9") + 1):
    CLASS[_b] = DIGIT
for _b in (9, 10, 11, 12, 13, 32):
    CLASS[_b] = SPACE


cdef inline Py_ssize_t contraction(const unsigned char* p, Py_ssize_t i, Py_ssize_t end):
    """The length of a contraction starting at i (p[i] is a quote), else 0."""
    cdef unsigned char d, e
    if i + 1 >= end:
        return 0
    d = p[i + 1]
    if d == b"s" or d == b"t" or d == b"m" or d == b"d":
        return 2
    if i + 2 < end:
        e = p[i + 2]
        if (d == b"r" and e == b"e") or (d == b"v" and e == b"e") or (d == b"l" and e == b"l"):
            return 3
    return 0


cdef inline Py_ssize_t piece_end(const unsigned char* p, Py_ssize_t i, Py_ssize_t end):
    """Where the piece starting at i ends (GPT-2's split of p[:end], ASCII)."""
    cdef unsigned char c = p[i]
    cdef unsigned char cls
    cdef Py_ssize_t j = i, k, m
    if c == b"'":
        k = contraction(p, i, end)
        if k:
            return i + k
    if c == b" " and i + 1 < end and CLASS[p[i + 1]] != SPACE:
        j = i + 1  # the optional space of alternatives 2-4
    cls = CLASS[p[j]]
    if cls != SPACE:
        k = j + 1
        while k < end and CLASS[p[k]] == cls:
            k += 1
        return k
    m = i + 1
    while m < end and CLASS[p[m]] == SPACE:
        m += 1
    if m == end:
        return end
    if m - 1 > i:
        return m - 1
    return i + 1


cdef class AsciiScanner:
    """The encoder of ASCII texts: ``words`` maps a piece to its ids, ``miss(piece)`` gives (and
    caches) those of a piece it lacks; ``specials`` is the added tokens as (text, id), longest
    first."""

    cdef dict words
    cdef object miss
    cdef list names  # the ASCII added tokens as (bytes, id), longest first
    cdef unsigned char opener[256]  # 1 for a byte that starts an added token

    def __init__(self, dict words, object miss, list specials):
        self.words, self.miss = words, miss
        self.names = [(s.encode("ascii"), s_id) for s, s_id in specials if s.isascii()]
        memset(self.opener, 0, 256)
        for name, _ in self.names:
            self.opener[name[0]] = 1

    def encode(self, str text, Py_ssize_t stride, Py_ssize_t base_char, Py_ssize_t base_tok):
        """(ids, (cut chars, cut tokens)) of an ASCII ``text``, cuts about every ``stride``
        tokens (0: none), after a piece and never after a piece that is all whitespace
        (``str.isspace``), shifted by the bases."""
        cdef bytes raw = text.encode("ascii")
        cdef const unsigned char* p = raw
        cdef Py_ssize_t n = len(raw), i = 0, j, start, stop, k, t, last, target
        cdef Py_ssize_t pieces = 0
        cdef list ids = []
        cdef dict words = self.words
        cdef list names = self.names
        cdef object got
        cdef bytes name
        # per piece: its end in characters and in tokens, and whether it is whitespace
        cdef Py_ssize_t* char_end = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
        cdef Py_ssize_t* tok_end = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
        cdef unsigned char* space = <unsigned char*>PyMem_Malloc(n + 1)
        cdef list cut_chars = [], cut_tokens = []
        if char_end == NULL or tok_end == NULL or space == NULL:
            PyMem_Free(char_end)
            PyMem_Free(tok_end)
            PyMem_Free(space)
            raise MemoryError()
        try:
            start = 0
            while start < n:
                # the next added token at or after start: the text before it is split alone
                stop, got = n, None
                if names:
                    j = start
                    while j < n and got is None:
                        if self.opener[p[j]]:
                            for name, s_id in names:
                                k = len(name)
                                if j + k <= n and memcmp(p + j, <const char*>name, k) == 0:
                                    stop, got = j, (k, s_id)
                                    break
                        j += 1
                i = start
                while i < stop:
                    j = piece_end(p, i, stop)
                    piece = text[i:j]
                    word = words.get(piece)
                    if word is None:
                        word = self.miss(piece)
                    ids += word
                    char_end[pieces] = j
                    tok_end[pieces] = len(ids)
                    space[pieces] = 1  # piece.isspace(), as the Python path asks
                    for k in range(i, j):
                        if not ISSPACE[p[k]]:
                            space[pieces] = 0
                            break
                    pieces += 1
                    i = j
                if got is None:
                    break
                k, s_id = got
                ids.append(s_id)
                char_end[pieces] = stop + k
                tok_end[pieces] = len(ids)
                space[pieces] = 0
                pieces += 1
                start = stop + k
            if stride > 0:
                last, target, t = pieces - 1, stride, 0
                while target < len(ids):
                    while t < pieces and tok_end[t] < target:
                        t += 1  # the first piece ending at or after the target
                    while t < last and space[t]:
                        t += 1  # never after whitespace: how a run splits depends on what follows
                    if t >= last:
                        break
                    cut_chars.append(base_char + char_end[t])
                    cut_tokens.append(base_tok + tok_end[t])
                    target = tok_end[t] + stride
            return ids, (cut_chars, cut_tokens)
        finally:
            PyMem_Free(char_end)
            PyMem_Free(tok_end)
            PyMem_Free(space)


def common_prefix(str a not None, str b not None):
    """text_runs.common_prefix: how many leading characters ``a`` and ``b`` share. Texts stored
    alike (one kind: 1, 2 or 4 bytes a character) are compared a block at a time with memcmp up
    to the block that differs, then character by character."""
    cdef Py_ssize_t n = min(PyUnicode_GET_LENGTH(a), PyUnicode_GET_LENGTH(b)), i = 0
    cdef unsigned int ka = PyUnicode_KIND(a), kb = PyUnicode_KIND(b)
    cdef char* da = <char*>PyUnicode_DATA(a)
    cdef char* db = <char*>PyUnicode_DATA(b)
    if ka == kb:
        while i + 256 <= n and memcmp(da + i * ka, db + i * ka, 256 * ka) == 0:
            i += 256
    while i < n and PyUnicode_READ(ka, da, i) == PyUnicode_READ(kb, db, i):
        i += 1
    return i
