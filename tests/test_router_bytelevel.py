"""The compiled byte-level scan (router._bytelevel) against its Python twin (router.fastbpe with
compiled=False) and the Rust tokenizer: the same ids and the same cuts on any ASCII text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router import fastbpe
from kvmesh.router.fastbpe import FastBPE

# the split's corner cases: contractions and quotes, each whitespace kind, str.isspace's extra
# \x1c-\x1f, every class next to a space, added tokens whole and cut short
ASCII_FRAGMENTS = [
    *("'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'", "'S", "'r", "'l"),
    *(" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "\x0b", "\x0c", " \n ", "\x1c", "\x1f"),
    *("a", "Zed", "word", "0", "42", "3.14", "_", "#", "!?", "...", "\x00", "\x7f", "-->"),
    *("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_sta", "rt|>", "<file_sep>", "<"),
    *("def f(x):", "    return x", "don't", "I'M", "rock'n'roll", "#3.1415"),
]
ascii_texts = st.lists(
    st.one_of(st.sampled_from(ASCII_FRAGMENTS), st.text(st.characters(max_codepoint=127)))
).map("".join)


@pytest.fixture(scope="module")
def backend():
    from kvmesh.protocol.tokenizer import load_tokenizer

    return load_tokenizer(None)[0].backend_tokenizer


@pytest.fixture(scope="module")
def twins(backend):
    compiled = FastBPE.probe(backend)
    assert compiled is not None and compiled.scan is not None, "router._bytelevel is not built"
    python = FastBPE(compiled.model, compiled.added, compiled=False)
    assert python.scan is None
    return compiled, python


def test_the_compiled_scan_is_built_and_used():
    """The install builds it (setup.py): without it the router silently runs the slower twin."""
    assert fastbpe.AsciiScanner is not None


@settings(max_examples=600, deadline=None)
@given(text=ascii_texts, stride=st.sampled_from([1, 3, 16]), bases=st.tuples(st.integers(0, 9)))
def test_the_compiled_scan_equals_its_python_twin_and_the_rust_tokenizer(
    twins, backend, text, stride, bases
):
    compiled, python = twins
    ids = backend.encode(text, add_special_tokens=False).ids
    assert compiled.encode(text) == python.encode(text) == ids
    base = bases[0]
    assert compiled.encode_with_cuts(text, base, 2 * base, stride) == python.encode_with_cuts(
        text, base, 2 * base, stride
    )


def test_a_text_the_scan_does_not_take_goes_the_python_way(twins, monkeypatch):
    """Non-ASCII and longer than SCAN_CHARS: the Python path (a long text is split off the GIL)."""
    compiled, python = twins
    calls = []
    scan = compiled.scan
    monkeypatch.setattr(compiled, "scan", lambda *a: calls.append(a) or scan(*a))
    monkeypatch.setattr(fastbpe, "SCAN_CHARS", 64)
    for text in ("héllo wörld", "a plain ascii text " * 8):
        assert compiled.encode(text) == python.encode(text)
    assert calls == []
    assert compiled.encode("short and ascii") == python.encode("short and ascii") and calls


def test_words_the_cache_lacks_are_added_once(twins):
    compiled, _ = twins
    compiled.words.clear()
    compiled.encode("zebra quagga zebra")
    assert {" quagga", "zebra", " zebra"} <= set(compiled.words)
    before = dict(compiled.words)
    compiled.encode("zebra quagga zebra")
    assert compiled.words == before


def test_a_character_newer_than_pythons_tables_is_left_to_the_rust_tokenizer(backend):
    """U+3D000 is a letter to the `regex` module's tables and unassigned (punctuation-like) to
    the Rust tokenizer's and Python's: the fast path would split "\\U0003d000's" otherwise."""
    from kvmesh.protocol.tokenizer import load_tokenizer
    from kvmesh.router.tokens import PromptTokenizer

    text = "\U0003d000's and more"
    assert fastbpe.newer_letters().search(text)
    with pytest.raises(fastbpe.Declined):
        FastBPE.probe(backend).encode(text)
    tok = load_tokenizer(None)[0]
    pt = PromptTokenizer(tok)
    assert pt.encode_completion(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )
    long = text + " words" * 40  # through the text cache's runs too
    assert list(pt.ids_and_keys(long, False)[0]) == tok.encode(long, add_special_tokens=False)


# characters of every storage kind: ASCII, Latin-1 (one byte each), BMP (two), astral (four)
_KINDS = st.text(st.sampled_from("ab \n\x00éÿΩ東😀"), max_size=600)


@settings(max_examples=400, deadline=None)
@given(a=_KINDS, b=_KINDS, shared=st.integers(0, 600))
def test_the_compiled_common_prefix_equals_its_python_twin(a, b, shared):
    """router._bytelevel.common_prefix (memcmp a block at a time, a character loop across
    kinds) against text_runs.common_prefix_py, on texts sharing a long start (several
    blocks) stored alike or not."""
    from kvmesh.router import _bytelevel
    from kvmesh.router.text_runs import common_prefix_py

    b = a[:shared] + b
    for x, y in ((a, b), (b, a), (a, a), (a + "Ω", a + "a"), (a, "😀" + b)):
        assert _bytelevel.common_prefix(x, y) == common_prefix_py(x, y)
