"""The router's cached tokenizer: always equal to the uncached tokenizer and block hasher."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.protocol.hashing import BlockHasher, block_hash_to_int
from kvmesh.protocol.prompt import chat_prompt, decode_chat, prompt_token_ids
from kvmesh.router.tokens import PromptTokenizer

FRAGMENTS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|im_sta",
    "rt|>",
    "<file_sep>",
    " ",
    "  ",
    "     ",
    "\n",
    "\n\n",
    "\t",
    " \n ",
    "\r\n",
    "\u00a0",
    "\u2028",
    "1234567",
    "3.14159",
    "héllo",
    "😀",
    "👩‍💻",
    "日本語のテキスト",
    "e\u0301",
    "def f(x):",
    "    return x",
    "'s",
    "Hello",
    " world",
    "ﬁ",
    "{'k': [1, 2]}",
]


@pytest.fixture(scope="module")
def tok():
    from kvmesh.protocol.tokenizer import load_tokenizer

    return load_tokenizer(None)[0]


def encode_chat(pt: PromptTokenizer, messages: list[dict], **fields) -> list[int]:
    """A chat's ids as the router makes them: protocol.prompt's text, the cached encoder."""
    chat = chat_prompt(
        decode_chat(json.dumps({"messages": messages, **fields}).encode()), pt.tokenizer, None
    )
    return prompt_token_ids(pt.tokenizer, chat, pt.encode_completion)[0]


def ref_keys(ids, algo="sha256", block_size=16, **kw):
    digests = BlockHasher(algo, block_size).hash_blocks(ids, 0, None, **kw)
    return [block_hash_to_int(d) for d in digests]


pieces = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=30).map(
    "".join
)
histories = st.tuples(
    pieces,
    st.lists(
        st.tuples(
            st.integers(0, 100),  # which earlier text to continue
            st.one_of(st.none(), st.floats(0.0, 1.0)),  # None: append; else keep a prefix
            pieces,
        ),
        min_size=1,
        max_size=8,
    ),
)


@pytest.fixture(scope="module")
def cached(tok):
    # Short runs and strides so that short texts exercise every cached path; the caches are
    # shared by all examples, so texts also meet the runs of earlier examples.
    return [
        PromptTokenizer(tok, block_size=4, min_run_chars=8, cut_stride=2, hash_span=2),
        PromptTokenizer(tok, min_run_chars=32, cut_stride=8, hash_span=4),
    ]


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(history=histories, salt=st.sampled_from([None, "", "s1"]))
def test_cached_results_always_equal_uncached(tok, cached, history, salt):
    base, steps = history
    texts = [base]
    for pick, keep, piece in steps:
        prev = texts[pick % len(texts)]
        if keep is not None:
            prev = prev[: int(len(prev) * keep)]
        texts.append(prev + piece)
    for text in texts:
        expect = tok.encode(text, add_special_tokens=False)
        for pt in cached:
            ids = pt.encode_completion(text, add_special_tokens=False)
            assert ids == expect, repr(text)
            assert pt.encode_completion(text) == tok.encode(text, add_special_tokens=True)
            want = ref_keys(ids, block_size=pt.block_size, cache_salt=salt)
            assert pt.block_keys(ids, cache_salt=salt) == want
            # ids and keys together, through the text cache's own block keys when unsalted
            for special in (False, True):
                full = tok.encode(text, add_special_tokens=special)
                got_ids, got_keys = pt.ids_and_keys(text, special, salt)
                assert list(got_ids) == full, repr(text)
                assert got_keys == ref_keys(full, block_size=pt.block_size, cache_salt=salt)


def test_growing_context_encodes_and_hashes_only_the_tail(tok):
    pt = PromptTokenizer(tok)
    words = ["the", "cache", "keeps", "42", "blocks;", "déjà", "vu", "😀", "def", "run(x):\n"]
    words += ["", "", "", "return", "x", "*", "2\n\n"]
    history = [{"role": "system", "content": "You are a careful coding agent."}]
    while sum(len(m["content"]) for m in history) < 20_000:
        n = len(history)
        body = " ".join(words[(n + i) % len(words)] for i in range(120))
        history.append({"role": "user" if n % 2 else "assistant", "content": f"turn {n}: {body}"})
    first = encode_chat(pt, history)
    text1 = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert first == tok.encode(text1, add_special_tokens=False)
    assert len(text1) > 20_000
    keys1 = pt.block_keys(first)
    assert keys1 == ref_keys(first)

    history.append({"role": "assistant", "content": "Done. " + " ".join(words * 6)})
    history.append({"role": "user", "content": "Now run the tests again, please."})
    text2 = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert text2.startswith(text1)
    before = (pt.stats.chars_encoded, pt.stats.blocks_hashed, pt.stats.blocks_reused)
    t0 = time.perf_counter()
    second = encode_chat(pt, history)
    keys2 = pt.block_keys(second)
    elapsed = time.perf_counter() - t0
    assert second == tok.encode(text2, add_special_tokens=False)
    assert keys2 == ref_keys(second)
    tail_chars = len(text2) - len(text1)
    chars = pt.stats.chars_encoded - before[0]
    hashed = pt.stats.blocks_hashed - before[1]
    new_blocks = len(second) // 16 - len(first) // 16
    # Overlap re-encoded: below the margin + two cut strides (~350 chars here).
    assert tail_chars <= chars <= tail_chars + 600, (chars, tail_chars)
    # Blocks hashed: the new ones plus at most one hash span of already known blocks.
    assert new_blocks <= hashed <= new_blocks + pt.hash_span, (hashed, new_blocks)
    assert pt.stats.blocks_reused - before[2] >= len(first) // 16 - pt.hash_span
    assert pt.stats.prefix_hits == 1 and pt.stats.seam_failures == 0
    print(f"\nturn 2: {len(text2)} chars, {chars} encoded, {hashed} blocks hashed, {elapsed:.4f}s")

    again = encode_chat(pt, history)  # an identical prompt (a retry) encodes nothing
    assert again == second and pt.stats.exact_hits == 1
    assert pt.stats.chars_encoded - before[0] == chars
    assert pt.cache_info()["runs"] == 1  # the first turn's run was superseded and dropped


def test_a_prompt_extending_a_known_one_hashes_only_its_new_blocks(tok):
    pt = PromptTokenizer(tok)
    base = " ".join(f"line {i}: the agent reads file_{i}.py and edits it." for i in range(200))
    ids, keys = pt.ids_and_keys(base, True)
    assert keys == ref_keys(tok.encode(base, add_special_tokens=True))
    for i, tail in enumerate([" Then it runs the tests.", " #1", " #2 and more words " * 20]):
        hashed = pt.stats.blocks_hashed
        ids2, keys2 = pt.ids_and_keys(base + tail, True)
        full = tok.encode(base + tail, add_special_tokens=True)
        assert list(ids2) == full and keys2 == ref_keys(full)
        # the shared blocks are the cached run's: only blocks holding the new text are hashed
        old = [*ids, -1]
        same = next(j for j, (a, b) in enumerate(zip(full, old, strict=False)) if a != b)
        assert pt.stats.blocks_hashed - hashed == len(full) // 16 - same // 16, i
    assert pt.stats.full_encodes == 1 and pt.stats.prefix_hits == 3


def test_a_known_text_with_a_new_ending_re_encodes_from_where_they_differ(tok):
    """A prompt that repeats a known one but for its last characters (a shared context with a
    new question, a benchmark's unique suffix) agrees with it character by character, so only
    a seam before the difference is encoded again."""
    pt = PromptTokenizer(tok)
    base = " ".join(f"line {i}: the agent reads file_{i}.py and edits it." for i in range(200))
    pt.ids_and_keys(base + " #0", True)
    for i in range(1, 40):
        text = f"{base} #{i * 7919}"
        chars = pt.stats.chars_encoded
        ids, keys = pt.ids_and_keys(text, True)
        full = tok.encode(text, add_special_tokens=True)
        assert list(ids) == full and keys == ref_keys(full)
        # the margin, a seam of a cut stride or two and the new characters (~80 here)
        assert pt.stats.chars_encoded - chars < pt.min_run_chars, i
    assert pt.stats.full_encodes == 1 and pt.stats.seam_failures == 0


def test_branching_and_unrelated_texts(tok):
    pt = PromptTokenizer(tok, min_run_chars=32)
    root = "System: be terse.\n" + "Shared context line with numbers 123456.\n" * 40
    texts = [root + "Question A? " * 30, root + "Question B! " * 30, "x" * 500, root[:-7] + "  \n"]
    for text in texts * 2:
        ids = pt.encode_completion(text, add_special_tokens=False)
        assert ids == tok.encode(text, add_special_tokens=False)
        assert pt.block_keys(ids, lora_name="l1") == ref_keys(ids, lora_name="l1")
    assert pt.stats.prefix_hits >= 2 and pt.stats.exact_hits == 4


def test_block_keys_odd_ids_and_partial_blocks(tok):
    pt = PromptTokenizer(tok, hash_algo="xxhash_cbor", block_size=8)
    assert pt.block_keys([1, 2, 3]) == []
    ids = list(range(100))
    assert pt.block_keys(ids) == ref_keys(ids, "xxhash_cbor", 8)
    assert pt.block_keys(ids[:50]) == ref_keys(ids[:50], "xxhash_cbor", 8)
    big = [2**40, -1] + ids  # not uint32: hashed without the cache, still exact
    assert pt.block_keys(big) == ref_keys(big, "xxhash_cbor", 8)


def test_chat_drops_none_keys_like_the_engine(tok):
    pt = PromptTokenizer(tok)
    msgs = [{"role": "user", "content": "hi", "name": None}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=False
    )
    assert encode_chat(pt, msgs, add_generation_prompt=False) == tok.encode(
        text, add_special_tokens=False
    )


class _Wrapped:
    """A tokenizer built on the real one, with behaviours the cache must not be fooled by."""

    def __init__(self, tok, prepend_space=False, offsets=True, bos=None):
        self.tok, self.prepend, self.offsets, self.bos = tok, prepend_space, offsets, bos

    def get_added_vocab(self):
        return self.tok.get_added_vocab()

    def encode(self, text, add_special_tokens=True):
        ids = self.tok.encode((" " if self.prepend else "") + text, add_special_tokens=False)
        return ([self.bos] if add_special_tokens and self.bos is not None else []) + ids

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        if not self.offsets:
            raise NotImplementedError("slow tokenizer")
        shift = 1 if self.prepend else 0
        enc = self.tok(
            (" " if self.prepend else "") + text,
            add_special_tokens=False,
            **{"return_offsets_mapping": True},
        )
        offs = [(max(0, s - shift), max(0, e - shift)) for s, e in enc["offset_mapping"]]
        return {"input_ids": enc["input_ids"], "offset_mapping": offs}


@pytest.mark.parametrize("kw", [{"prepend_space": True}, {"offsets": False}, {"bos": 0}], ids=str)
def test_non_local_or_unusual_tokenizers_stay_exact(tok, kw):
    fake = _Wrapped(tok, **kw)
    pt = PromptTokenizer(fake, min_run_chars=16)
    text = "word " * 20
    for i in range(30):
        text += f"turn{i} hello world\n"
        assert pt.encode_completion(text, add_special_tokens=False) == fake.encode(text, False)
        assert pt.encode_completion(text) == fake.encode(text, True)
        for special in (True, False):
            ids, keys = pt.ids_and_keys(text, special)
            assert list(ids) == fake.encode(text, special) and keys == ref_keys(list(ids))
    if kw.get("prepend_space"):
        assert pt.stats.seam_failures >= 8 and not pt._cacheable  # gave up caching
    if kw.get("bos") is not None:
        assert pt.stats.prefix_hits > 0


def test_caches_stay_within_budgets(tok):
    pt = PromptTokenizer(tok, cache_entries=3, cache_tokens=400, hash_cache_blocks=40)
    shared = "A long shared system prompt, repeated. " * 20
    for i in range(12):
        text = shared + f"session {i}: " + "more words " * (i + 5)
        ids = pt.encode_completion(text, add_special_tokens=False)
        assert ids == tok.encode(text, add_special_tokens=False)
        assert pt.block_keys(ids) == ref_keys(ids)
        info = pt.cache_info()
        assert info["runs"] <= 3 and info["hash_blocks"] <= 40
        assert info["tokens"] <= 400 or info["runs"] == 1


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=16))).map("".join))
def test_fast_byte_level_bpe_equals_the_rust_tokenizer(tok, text):
    backend = tok.backend_tokenizer
    fast = _fast(backend)
    try:
        ids = fast.encode(text)
    except UnicodeError:  # fastbpe.Declined (lone surrogates, newer characters): the Rust path
        return
    assert ids == backend.encode(text, add_special_tokens=False).ids
    with_cuts, (chars, tokens) = fast.encode_with_cuts(text, 5, 7, 3)
    assert with_cuts == ids
    for c, t in zip(chars, tokens, strict=True):  # each cut splits text and ids alike
        assert fast.encode(text[: c - 5]) == ids[: t - 7]


ASCII_PIECES = [
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'",
    " ",
    "  ",
    "\n",
    "\t",
    "\r\n",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1f",
    "a",
    "Z",
    "0",
    "9",
    "_",
    "#",
    "!?",
    "\x00",
    "\x7f",
]


@settings(max_examples=500, deadline=None)
@given(
    text=st.lists(
        st.one_of(st.sampled_from(ASCII_PIECES), st.text(st.characters(max_codepoint=127)))
    ).map("".join)
)
def test_the_ascii_split_equals_the_unicode_split_on_ascii_text(text):
    import re

    import regex

    from kvmesh.router.fastbpe import ASCII_SPLIT, GPT2_SPLIT

    assert re.findall(ASCII_SPLIT, text) == regex.findall(GPT2_SPLIT, text)


_FAST: dict = {}


def _fast(backend):
    from kvmesh.router.fastbpe import FastBPE

    if "bpe" not in _FAST:
        _FAST["bpe"] = FastBPE.probe(backend)
    assert _FAST["bpe"] is not None
    return _FAST["bpe"]


def test_fast_bpe_refuses_other_tokenizer_layouts(tok):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from kvmesh.router.fastbpe import FastBPE

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    assert FastBPE.probe(backend) is not None
    backend.normalizer = normalizers.Lowercase()
    assert FastBPE.probe(backend) is None
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    assert FastBPE.probe(backend) is None
    assert FastBPE.probe(Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))) is None


def test_a_long_prompt_seen_whole_is_answered_by_the_text_cache_alone(tok):
    """A text the text cache holds is known again by a compare with its neighbour in order:
    nothing encoded or hashed, and no second copy of it in the whole-prompt cache."""
    pt = PromptTokenizer(tok)
    text = "a prompt long enough to fill several blocks of sixteen tokens each, " * 4
    ids, keys = pt.ids_and_keys(text, False)
    assert list(ids) == tok.encode(text, add_special_tokens=False) and keys == ref_keys(list(ids))
    encodes, hashed, chars = pt.stats.full_encodes, pt.stats.blocks_hashed, pt.stats.chars_encoded
    again = pt.ids_and_keys(text, False)
    assert list(again[0]) == list(ids) and again[1] == keys and pt.stats.exact_hits == 1
    assert (pt.stats.full_encodes, pt.stats.blocks_hashed) == (encodes, hashed)
    assert pt.stats.chars_encoded == chars and pt.cache_info()["whole_prompts"] == 0


def test_a_prompt_seen_whole_is_answered_from_the_whole_prompt_cache(tok):
    pt = PromptTokenizer(tok, whole_entries=2)
    text = "a short prompt that fills a block of sixteen tokens: one, two, three, four."
    assert len(text) < pt.min_run_chars  # (the text cache leaves it out)
    ids, keys = pt.ids_and_keys(text, False)
    ids = list(ids)
    assert ids == tok.encode(text, add_special_tokens=False) and keys == ref_keys(ids)
    encodes, hashed = pt.stats.encodes, pt.stats.blocks_hashed
    again = pt.ids_and_keys(text, False)
    assert list(again[0]) == ids and again[1] == keys and pt.stats.whole_hits == 1
    assert (pt.stats.encodes, pt.stats.blocks_hashed) == (encodes, hashed)  # nothing computed
    # the salt and the special tokens are part of the key
    salted = pt.ids_and_keys(text, False, "s1")
    assert salted[1] == ref_keys(ids, cache_salt="s1") and pt.stats.whole_hits == 1
    assert list(pt.ids_and_keys(text, True)[0]) == tok.encode(text, add_special_tokens=True)
    assert pt.cache_info()["whole_prompts"] == 2  # at most whole_entries, oldest dropped
    pt.ids_and_keys(text, False)
    assert pt.stats.whole_hits == 1  # (text, False, None) was the oldest: dropped
    pt.set_block_size(32)  # keys of another block size: the cache starts anew
    assert pt.cache_info()["whole_prompts"] == 0
    assert pt.ids_and_keys(text, False)[1] == ref_keys(ids, block_size=32)


def test_the_whole_prompt_cache_keeps_at_most_its_token_budget(tok):
    pt = PromptTokenizer(tok, whole_tokens=40)
    pt.ids_and_keys("word " * 100, False)  # more than the whole budget: not kept
    assert pt.cache_info()["whole_prompts"] == 0
    for i in range(6):
        pt.ids_and_keys(f"prompt {i}: " + "word " * 12, False)
        held = [len(ids) for ids, _ in pt._whole.values()]
        assert sum(held) == pt._whole_held <= 40
    assert pt.cache_info()["whole_prompts"] == 2  # about 15 tokens each: the newest two


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab é\n", max_size=40), st.text(alphabet="ab é\n", max_size=40))
def test_the_common_prefix_of_two_texts_is_where_a_walk_first_finds_them_differ(a, b):
    """text_runs.common_prefix (one compare, else a binary search) against a walk, with b
    often a longer or shorter copy of a."""
    from kvmesh.router.text_runs import common_prefix

    for x, y in ((a, b), (a, a + b), (a + b, a), (a + b, a + a)):
        n = 0
        while n < len(x) and n < len(y) and x[n] == y[n]:
            n += 1
        assert common_prefix(x, y) == n


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet="ab é", max_size=12), min_size=1, max_size=30), st.data())
def test_the_run_store_finds_the_kept_text_sharing_the_longest_prefix(texts, data):
    """RunStore.find against a scan of every kept text, as runs are added, superseded and
    dropped for their budget."""
    from kvmesh.router.text_runs import Run, RunStore, common_prefix

    store = RunStore(max_runs=8, max_tokens=10**6)
    for text in texts:
        found = store.find(text)
        kept = list(store.runs)
        best = max((common_prefix(r.text, text) for r in kept), default=0)
        if text in [r.text for r in kept]:
            assert found.exact is not None and found.exact.text == text
        else:
            assert found.exact is None and found.agree == best
            assert (found.run is None) == (best == 0)
            if found.run is not None:
                assert common_prefix(found.run.text, text) == best
                assert found.extends == (best == len(found.run.text))
            store.add(Run(text, [len(text)], ([0], [0])), found)
        store.settle()
        assert store.texts == sorted(r.text for r in store.runs) == [r.text for r in store.ordered]
        assert len(store.runs) <= 8
    if store.runs and data.draw(st.booleans()):
        store.drop(next(iter(store.runs)))
        assert store.texts == sorted(r.text for r in store.runs)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=30),
    st.lists(st.integers(0, 2**32 - 1), max_size=30),
    st.integers(0, 30),
)
def test_two_id_arrays_first_differ_where_a_walk_says(a, b, shared):
    """text_runs.first_difference (XOR of the arrays' bytes) against a walk."""
    from array import array

    from kvmesh.router.text_runs import first_difference

    b = a[:shared] + b  # often a long common run
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    assert first_difference(array("I", a), array("I", b)) == n
