"""The incremental detokenizer (Rust DecodeStream path and the wrapper path) against a full
decode of the same ids, and the verified Rust encode against the wrapper's encode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.tokenizer import encode, rust_backend

TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cn", "Co")), min_size=0, max_size=60
) | st.sampled_from(["déjà vu 😀 42 ", "def f(x):\n\treturn x  # 注释\n", "<|im_end|> next"])
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tokenizer, ids: list[int], fast: bool, skip: bool = True) -> str:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    if not fast:
        detok._stream = None  # the transformers-wrapper path
    for token in ids:
        detok.add(token)
    return detok.release(final=True)


def test_rust_backend_is_verified_for_the_default_tokenizer(tokenizer) -> None:
    assert rust_backend(tokenizer) is not None
    assert IncrementalDetokenizer(tokenizer)._stream is not None


@pytest.mark.parametrize("fast", [True, False])
@SETTINGS
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_streamed_text_equals_full_decode(tokenizer, fast: bool, texts: list[str]) -> None:
    ids = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert stream(tokenizer, ids, fast) == full


@SETTINGS
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=40))
def test_streamed_random_ids_equal_full_decode(tokenizer, ids: list[int]) -> None:
    full = tokenizer.decode(ids, skip_special_tokens=False)
    if "\ufffd" not in full:  # broken UTF-8 in the middle decodes differently by design
        assert stream(tokenizer, ids, True, skip=False) == full


@SETTINGS
@given(text=TEXT, special=st.booleans())
def test_fast_encode_equals_wrapper(tokenizer, text: str, special: bool) -> None:
    assert encode(tokenizer, text, special) == tokenizer.encode(text, add_special_tokens=special)
