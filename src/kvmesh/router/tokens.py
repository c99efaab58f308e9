"""Prompt tokenization for routing, cached for growing (agentic) prompts; the prompt's block
hashes come from router.block_keys, cached too. What text a request's prompt is (its chat
rendering, its checks) is protocol.prompt's, shared with the engine; this module only encodes.

A prompt seen before whole (a retry, a benchmark, a repeated question) is answered with no
encoding or block hashing: a short one (under ``min_run_chars``, which the text cache leaves out)
from a small LRU of whole prompts, a longer one from the text cache's exact hit below.

An agent's next prompt is usually its last prompt plus more text. Each encoded text is kept as a
*run*: its ids and *cuts*, token boundaries that fall on character boundaries; router.text_runs
finds the run agreeing longest with a text (a neighbour of it in the runs' sorted texts). A
text that agrees with a run for ``a`` characters reuses the run's ids up to a cut ``c0``
safely before ``a`` and encodes only ``text[c0:]``. Byte-level BPE pre-tokenisation is local,
but this is verified, not assumed: the fresh tail must reproduce the run's tokens from ``c0``
to the next cut ``c1`` (the seam), and a non-space character must follow ``c0`` before the
texts may differ (whitespace runs are split by lookahead); otherwise the whole text is encoded.

Not thread-safe: the router calls it from one event loop.
"""

from __future__ import annotations

import contextlib
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvmesh.protocol.hashing import DEFAULT_BLOCK_SIZE, block_hash_to_int
from kvmesh.protocol.tokenizer import fast_backend, offsets_work, special_affixes
from kvmesh.router.block_keys import BlockKeyCache, TokenizerStats
from kvmesh.router.fastbpe import FastBPE
from kvmesh.router.text_runs import Run, RunStore, first_difference, offset_cuts


def _first(items: list, n: int) -> list:
    """items[:n], or items itself when that is all of it (lists shared read-only)."""
    return items if n >= len(items) else items[:n]


class PromptTokenizer:
    """The router's tokenizer: exact engine token ids and block hashes, computed incrementally."""

    def __init__(
        self,
        tokenizer: Any,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hash_algo: str = "sha256",
        cache_entries: int = 4096,
        *,
        cache_tokens: int = 4_000_000,
        hash_cache_blocks: int = 262_144,
        min_run_chars: int = 128,
        cut_stride: int = 8,
        hash_span: int = 16,
        whole_entries: int = 1024,
        whole_tokens: int = 262_144,
    ) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.min_run_chars = min_run_chars  # shorter texts are not kept as runs
        self.cut_stride = cut_stride
        self.hash_span = hash_span
        self.stats = TokenizerStats()
        # keeps at most hash_cache_blocks block digests; counts into self.stats
        self._keys = BlockKeyCache(block_size, hash_algo, hash_cache_blocks, hash_span, self.stats)
        # the text cache: at most cache_entries runs and cache_tokens ids over all of them
        self._runs = RunStore(cache_entries, cache_tokens)
        # (text, add_special_tokens, cache_salt) -> (ids, keys), oldest first. Invariant: at
        # most whole_entries entries and whole_tokens ids over all (_whole_held of them)
        self._whole: OrderedDict[tuple[str, bool, str | None], tuple[Sequence[int], list[int]]]
        self._whole = OrderedDict()
        self.whole_entries, self.whole_tokens, self._whole_held = whole_entries, whole_tokens, 0
        # whole prompts to keep, not yet kept: each call keeps them first (so none can tell),
        # and the router settles once the request is on its way, as for the text cache's runs
        self._deferred: list[tuple] = []
        added = getattr(tokenizer, "get_added_vocab", dict)()
        # Texts may differ right after the agreed prefix, and a special token that starts up to
        # its length before that point may be matched in one text only: stay clear of both.
        self._margin = 16 + max((len(t) for t in added), default=48)
        self._backend = fast_backend(tokenizer)
        self._bpe = FastBPE.probe(self._backend) if self._backend is not None else None
        self._cacheable = offsets_work(tokenizer)
        self._specials = special_affixes(tokenizer)

    def _plain(self, text: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode`` without the transformers wrapper's ~100 us per call, when the
        Rust tokenizer underneath was checked to give the same ids."""
        if self._bpe is not None and not add_special_tokens:
            with contextlib.suppress(UnicodeError):  # fastbpe.Declined: the Rust path
                return self._bpe.encode(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- public API -----------------------------------------------------------------------
    def encode_completion(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Exactly ``tokenizer.encode(prompt, add_special_tokens=add_special_tokens)``: the
        router's encoder of every prompt text, a completion's or a rendered chat's
        (protocol.prompt makes the text)."""
        if self._deferred:
            self.settle()
        if not add_special_tokens:
            return self._encode_raw(prompt)
        if self._specials is None:
            self.stats.chars_encoded += len(prompt)
            return self._plain(prompt, True)
        pre, post = self._specials
        return pre + self._encode_raw(prompt) + post

    def ids_and_keys(
        self, text: str, add_special_tokens: bool, cache_salt: str | None = None
    ) -> tuple[Sequence[int], list[int]]:
        """``encode_completion(text, add_special_tokens)`` and its ``block_keys`` (with
        ``cache_salt``), the pair kept for a prompt seen whole before. Both may be shared with
        earlier callers: read them, never change them. The ids of a cached text come as the
        text cache's compact ``array('I')``: a growing prompt's thousands of ids are copied as
        bytes, never made into as many int objects (the router reads only their count). A text
        the text cache holds is not keyed again by the whole-prompt cache: the text cache knows
        a repeat by comparing it with its neighbour in order, where a dict key would hash all
        of it again."""
        if self._deferred:
            self.settle()
        runs = cache_salt is None and (self._specials is not None or not add_special_tokens)
        if runs and self._cacheable and len(text) >= self.min_run_chars:
            return self._run_ids_and_keys(text, add_special_tokens)
        key = (text, add_special_tokens, cache_salt)
        whole = self._whole
        pair = whole.get(key)
        if pair is not None:
            whole.move_to_end(key)
            self.stats.whole_hits += 1
            return pair
        if runs:
            pair = self._run_ids_and_keys(text, add_special_tokens)
        else:
            ids = self.encode_completion(text, add_special_tokens)
            pair = ids, self.block_keys(ids, cache_salt) if ids else []
        if len(pair[0]) <= self.whole_tokens:
            self._deferred.append((key, pair))
        return pair

    def uncached_ids_and_keys(
        self, text: str, add_special_tokens: bool, cache_salt: str | None = None
    ) -> tuple[list[int], list[int]]:
        """``ids_and_keys``' ids and keys, computed whole without touching a cache but the fast
        encoder's word cache (safe to share): another thread may hold this tokenizer meanwhile
        (router.request_parser: a short prompt passing a long one being encoded)."""
        self.stats.uncached += 1
        if add_special_tokens and self._specials is not None:
            pre, post = self._specials
            ids = pre + self._plain(text, False) + post
        else:
            ids = self._plain(text, add_special_tokens)
        return ids, self.uncached_block_keys(ids, cache_salt)

    def uncached_block_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        """``block_keys`` hashed whole, no cache touched (as ``uncached_ids_and_keys``)."""
        digests = self._keys.hasher.hash_blocks(token_ids, 0, None, cache_salt=cache_salt)
        return [block_hash_to_int(d) for d in digests]

    def settle(self) -> None:
        """Apply the cache entries the last calls made."""
        self._runs.settle()
        deferred, self._deferred = self._deferred, []
        whole = self._whole
        for key, pair in deferred:
            whole[key] = pair
            self._whole_held += len(pair[0])
            while len(whole) > self.whole_entries or self._whole_held > self.whole_tokens:
                self._whole_held -= len(whole.popitem(last=False)[1][0])

    def _run_ids_and_keys(
        self, text: str, add_special_tokens: bool
    ) -> tuple[Sequence[int], list[int]]:
        """Ids and unsalted block keys of a prompt through the text cache: the keys of the
        blocks whose ids equal a cached run's are that run's, so a prompt that extends a known
        one hashes only its new blocks (and no span checkpoints)."""
        ids, run, parent, same = self._encode_run(text)
        pre, post = self._specials if add_special_tokens and self._specials else ([], [])
        bs, lead = self.block_size, len(pre)
        n_blocks = (lead + len(ids) + len(post)) // bs
        reuse = 0
        if parent is not None and parent.pre == pre:
            reuse = min(len(parent.keys), (lead + same) // bs, n_blocks)
        # the run's lists themselves when all of them are reused: read-only, shared (a prompt
        # that adds no full block costs no copy, nor a touch of each key)
        keys = _first(parent.keys, reuse) if reuse else []
        chain = _first(parent.chain, reuse) if reuse else []
        if reuse < n_blocks:
            a = reuse * bs  # ids of pre + ids + post from block `reuse` to the last full one
            seq = (
                pre[a:]
                + (
                    ids[max(0, a - lead) :].tolist()
                    if isinstance(ids, array)
                    else ids[max(0, a - lead) :]
                )
                + post
            )
            seq = seq[: (n_blocks - reuse) * bs]
            fresh = self._keys.hasher.hash_blocks(seq, 0, chain[-1] if chain else None)
            self.stats.blocks_hashed += len(fresh)
            chain = chain + fresh
            keys = keys + [block_hash_to_int(d) for d in fresh]
        self.stats.blocks_reused += reuse
        if run is not None and (run.pre != pre or len(run.keys) < len(keys)):
            kept = (lead + len(ids)) // bs  # blocks without suffix ids
            run.pre, run.keys, run.chain = pre, _first(keys, kept), _first(chain, kept)
        if pre or post:  # (a run's array is shared as it is: never changed once made)
            if isinstance(ids, array):
                ids = array("I", pre) + ids + array("I", post)
            else:
                ids = pre + ids + post
        return ids, keys

    def block_keys(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora_name: str | None = None
    ) -> list[int]:
        """The engine's block hashes of the full blocks, as KV-event ints."""
        return self._keys.block_keys(token_ids, cache_salt, lora_name)

    def set_block_size(self, block_size: int) -> None:
        """Block keys are made of ``block_size``-token blocks from now on (the engines' size,
        learned by the router): the block-key cache starts anew."""
        if self._deferred:
            self.settle()
        if block_size != self.block_size:
            old = self._keys
            self._keys = BlockKeyCache(
                block_size, old.hasher.algo, old.capacity_blocks, old.hash_span, self.stats
            )
            self.block_size = block_size
            self._whole.clear()
            self._whole_held = 0
            self._runs.forget_keys()  # made of blocks of the old size

    def cache_info(self) -> dict[str, int]:
        self.settle()
        return {
            "runs": len(self._runs.runs),
            "tokens": self._runs.tokens,
            "hash_blocks": self._keys.blocks,
            "whole_prompts": len(self._whole),
        }

    # ---- text cache -----------------------------------------------------------------------
    def _encode_raw(self, text: str) -> list[int]:
        ids = self._encode_run(text)[0]
        return ids.tolist() if isinstance(ids, array) else ids

    def _encode_run(self, text: str) -> tuple[Sequence[int], Run | None, Run | None, int]:
        """Ids of ``text``; the run now holding it (None: not cached); and a run (``parent``)
        whose ids equal these for the first ``same`` (so do their block keys)."""
        st = self.stats
        st.encodes += 1
        if not self._cacheable or len(text) < self.min_run_chars:
            st.full_encodes += 1
            st.chars_encoded += len(text)
            return self._plain(text, False), None, None, 0
        found = self._runs.find(text)
        if found.exact is not None:
            st.exact_hits += 1
            return found.exact.ids, found.exact, found.exact, len(found.exact.ids)
        run = found.run
        hit = self._extend(text, run, found.agree) if run is not None else None
        if hit is None:
            st.full_encodes += 1
            ids, cuts = self._encode_with_cuts(text, 0, 0)
            cuts = ([0, *cuts[0]], [0, *cuts[1]])
            parent, same = None, 0
        else:
            st.prefix_hits += 1
            ids, cuts, same = hit
            parent = run
        new = Run(text, ids, cuts)
        self._runs.add(new, found)
        return new.ids, new, parent, same

    def _extend(
        self, text: str, run: Run, agree: int
    ) -> tuple[array, tuple[array, array], int] | None:
        """Ids and cuts of ``text`` reusing ``run``, whose text starts with ``text[:agree]``,
        and how many of its first ids are the run's; None when no safe cut exists or the seam
        check fails."""
        limit = agree - self._margin
        cc, ct = run.cut_chars, run.cut_tokens
        j = bisect_right(cc, limit) - 1  # c1 = cc[j] <= limit ends the seam window
        while j >= 1 and text[cc[j - 1] : limit].isspace():
            j -= 1  # a whitespace run from c0 may end differently in the two texts
        if j < 1:
            return None
        c0, n0, n1 = cc[j - 1], ct[j - 1], ct[j]
        tail, (tail_chars, tail_tokens) = self._encode_with_cuts(text[c0:], c0, n0)
        if tail[: n1 - n0] != run.ids[n0:n1].tolist():
            st = self.stats
            st.seam_failures += 1
            if st.seam_failures >= 8 and st.seam_failures > 4 * st.prefix_hits:
                self._cacheable = False  # this tokenizer is not local (e.g. prepends a space)
            return None
        ids = run.ids[:n0]
        ids.extend(tail)
        same = n1 + first_difference(run.ids[n1 : n0 + len(tail)], array("I", tail[n1 - n0 :]))
        chars, tokens = cc[:j], ct[:j]  # copies: the run keeps its own
        chars.extend(tail_chars)
        tokens.extend(tail_tokens)
        return ids, (chars, tokens), same

    def _encode_with_cuts(
        self, text: str, base_char: int, base_tok: int
    ) -> tuple[list[int], tuple[list[int], list[int]]]:
        """Ids of ``text`` and its cuts (about every cut_stride tokens), shifted by the bases."""
        self.stats.chars_encoded += len(text)
        if self._bpe is not None:
            with contextlib.suppress(UnicodeError):  # fastbpe.Declined: the Rust path
                return self._bpe.encode_with_cuts(text, base_char, base_tok, self.cut_stride)
        if self._backend is not None:
            enc = self._backend.encode(text, add_special_tokens=False)
            ids, offsets = enc.ids, enc.offsets
        else:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = enc["input_ids"], enc["offset_mapping"]
        return ids, offset_cuts(offsets, self.cut_stride, base_char, base_tok)
