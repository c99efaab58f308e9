"""Prompt-lookup (n-gram) drafting over a request's own prompt and output tokens.

The draft for a sequence s of length L: take the longest n in [prompt_lookup_min,
prompt_lookup_max] whose suffix s[L-n:L] occurred earlier in s, pick its most recent earlier
occurrence s[j:j+n] (j + n < L), and propose s[j+n : j+n+k] (fewer when s ends first).

Each request keeps an incremental index instead of rescanning its context every step: prefix
hashes of s (a polynomial rolling hash mod 2^61 - 1) and, per n, a dict from the hash of every
n-gram to the end of its latest occurrence. Invariant: the index holds exactly the n-grams that
end at or before L - 1, so the suffix never matches itself and a hit is an earlier occurrence;
later occurrences overwrite earlier ones, so a hit is the most recent. With W = max - min + 1:
appending a token costs O(W), a proposal O(W + max + k) (a hit's tokens are compared, so a hash
collision is a miss, never a wrong draft), both independent of L; indexing a prompt of L
tokens costs O(L * W) once, and memory is O(L * W). Only verified tokens ever enter the index:
drafts are proposed, never appended, so rejected tokens need no rollback here.
"""

from __future__ import annotations

from collections.abc import Sequence

_MOD = (1 << 61) - 1
_BASE = 1_000_003


class NgramIndex:
    """One request's token sequence and its n-gram index."""

    __slots__ = ("tokens", "_min", "_max", "_prefix", "_pow", "_latest")

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                f"prompt_lookup_max ({prompt_lookup_max})"
            )
        self._min, self._max = prompt_lookup_min, prompt_lookup_max
        self.tokens: list[int] = []
        self._prefix = [0]  # _prefix[i]: hash of tokens[:i]
        self._pow = {n: pow(_BASE, n, _MOD) for n in range(self._min, self._max + 1)}
        self._latest: dict[int, dict[int, int]] = {n: {} for n in self._pow}  # hash -> end

    def __len__(self) -> int:
        return len(self.tokens)

    def _hash(self, start: int, end: int) -> int:
        return (self._prefix[end] - self._prefix[start] * self._pow[end - start]) % _MOD

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append verified tokens."""
        for tok in token_ids:
            # the old suffix (ending at the old length) becomes an earlier occurrence
            end = len(self.tokens)
            for n, latest in self._latest.items():
                if end >= n:
                    latest[self._hash(end - n, end)] = end
            self.tokens.append(tok)
            self._prefix.append((self._prefix[-1] * _BASE + tok + 1) % _MOD)

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens continuing the longest, most recent suffix match; [] if none."""
        s, length = self.tokens, len(self.tokens)
        for n in range(min(self._max, length - 1), self._min - 1, -1):
            end = self._latest[n].get(self._hash(length - n, length))
            if end is not None and s[end - n : end] == s[length - n :]:
                return s[end : end + k]
        return []


class NgramProposer:
    """Per-request indexes kept in step with each request's token ids.

    `propose` takes the request's full verified token list (prompt + output) and indexes only
    what was appended since the last call; a shorter list (the request restarted) rebuilds.
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.bounds = (prompt_lookup_min, prompt_lookup_max)
        NgramIndex(*self.bounds)  # validates the bounds now rather than on first use
        self._indexes: dict[str, NgramIndex] = {}

    @classmethod
    def from_config(cls, config) -> NgramProposer:
        """From a SpeculativeConfig with method 'ngram'."""
        return cls(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int = -1) -> list[int]:
        """Drafts for one request: at most k, and at most `max_tokens` when >= 0."""
        index = self._indexes.get(request_id)
        if index is None or len(index) > len(token_ids):
            index = self._indexes[request_id] = NgramIndex(*self.bounds)
        index.extend(token_ids[len(index) :])
        k = self.k if max_tokens < 0 else min(self.k, max_tokens)
        return index.propose(k) if k > 0 else []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._indexes)
