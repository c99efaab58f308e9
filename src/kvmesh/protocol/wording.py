"""How counts read in what users see: '1 endpoint', '2 endpoints'. Here so that every layer (cli,
engine, router, sim, bench) words them alike; imports nothing."""

from __future__ import annotations


def noun_for(count: int, noun: str, nouns: str | None = None) -> str:
    """The noun as `count` takes it: 'endpoint' for 1, 'endpoints' for 0 or 2 (nouns: an
    irregular plural, or a verb's: noun_for(n, 'is', 'are'))."""
    return noun if count == 1 else (nouns or noun + "s")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """'1 endpoint', '2 endpoints', '0 endpoints' (nouns: an irregular plural)."""
    return f"{count} {noun_for(count, noun, nouns)}"
