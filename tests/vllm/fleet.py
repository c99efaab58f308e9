"""Servers, their KV-event recorders and the router, as one object the tests drive; the checks
that compare what the router predicts with what vLLM reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.protocol.kv_events import AllBlocksCleared
from kvmesh.protocol.prom import parse_samples
from tests.vllm.events import EventRecorder
from tests.vllm.procs import SERVED_MODEL, Process, http

ENDPOINT_HEADER = "x-kvmesh-endpoint"


@dataclass
class Engine:
    """One scheduling endpoint: a vLLM server, or one data-parallel rank of it."""

    name: str  # the router's name for it (URL, with #dp<rank> for a rank)
    url: str
    events: EventRecorder
    headers: dict = field(default_factory=dict)  # pins a data-parallel rank when sent direct


@dataclass
class Fleet:
    router: Process
    engines: list[Engine]
    block_keys: Callable[[list[int]], list[int]]  # the router's keys of a prompt's token ids

    # ---- router metrics ---------------------------------------------------------------------
    def router_value(self, name: str, **labels: str) -> float:
        """Sum of the router's samples named `name` (any _total suffix) with these labels."""
        total = 0.0
        for s in parse_samples(http("GET", self.router.url + "/metrics")[2]):
            if s.name in (name, name + "_total") and labels.items() <= s.labels.items():
                total += s.value
        return total

    def wait_router(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"router: {what} not true in {timeout:.0f}s")
            time.sleep(0.2)

    def wait_index_in_sync(self) -> int:
        """Until the router's precise index holds exactly the blocks the engines' events say
        they cache (the sum over engines of what each recorder tracks). Returns that count."""

        def expected() -> int:
            return sum(len(e.events.cached) for e in self.engines)

        def in_sync() -> bool:
            return self.router_value("kvmesh_router_index_entries", index="precise") == expected()

        self.wait_router(in_sync, "precise index entries == blocks cached per KV events")
        return expected()

    # ---- requests ---------------------------------------------------------------------------
    def wait_blocks_published(self, engine: Engine, response: dict) -> None:
        """Until `engine`'s KV events have said that it caches every full block of the
        response's prompt (vLLM publishes them from another thread, after the answer)."""
        ids = response.get("prompt_token_ids") or response["choices"][0]["prompt_token_ids"]
        keys = set(self.block_keys(ids))
        engine.events.wait_for(lambda: keys <= engine.events.cached, "the prompt's BlockStored")

    def direct(self, engine: Engine, prompt: str, max_tokens: int = 1) -> dict:
        """A greedy completion sent to `engine` itself, past the router; returns once the
        engine's KV events have told of its prompt's blocks."""
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens}
        body |= {"temperature": 0, "return_token_ids": True}
        status, _, out = http("POST", engine.url + "/v1/completions", body, engine.headers)
        assert status == 200, out
        self.wait_blocks_published(engine, out)
        return out

    def routed(self, path: str, body: dict) -> tuple[str, dict, float]:
        """(endpoint chosen, response, tokens the router predicted cached there) for one
        non-streaming request through the router."""
        before_prompt = self.router_value("kvmesh_router_prompt_tokens")
        before = self.router_value("kvmesh_router_predicted_cached_tokens")
        body = {"model": SERVED_MODEL, "temperature": 0, "max_tokens": 2, **body}
        status, headers, out = http(
            "POST", self.router.url + path, body | {"return_token_ids": True}
        )
        assert status == 200, out
        chosen = headers[ENDPOINT_HEADER]
        self.wait_blocks_published(next(e for e in self.engines if e.name == chosen), out)
        want = before_prompt + out["usage"]["prompt_tokens"]
        # the router counts a request once its answer has passed to the client
        self.wait_router(lambda: self.router_value("kvmesh_router_prompt_tokens") >= want,
                         "the routed request counted")  # fmt: skip
        predicted = self.router_value("kvmesh_router_predicted_cached_tokens") - before
        return chosen, out, predicted

    def reset_caches(self) -> None:
        """POST /reset_prefix_cache on every server; vLLM publishes AllBlocksCleared with its
        next engine step, so a one-token request follows, then the router must be in sync."""
        for url in dict.fromkeys(e.url for e in self.engines):  # once per server, all ranks
            status, _, out = http("POST", url + "/reset_prefix_cache")
            assert status == 200 and out == {"success": True}, out
        for engine in self.engines:
            mark = engine.events.mark()
            self.direct(engine, "x")
            engine.events.wait_for(
                lambda e=engine, m=mark: bool(e.events.events(m, AllBlocksCleared)),
                f"AllBlocksCleared from {engine.name}",
            )
        self.wait_index_in_sync()


def routed_fleet(router: Process, engines: list[Engine], block_keys: Callable) -> Fleet:
    """The fleet once `router` answers /health and has subscribed to every engine's events
    (each publisher's replay applied)."""
    router.wait_healthy(120)
    fleet = Fleet(router, engines, block_keys)
    for e in engines:
        fleet.wait_router(
            lambda n=e.name: fleet.router_value("kvmesh_router_kv_index_warm", endpoint=n) == 1,
            f"KV index warm for {e.name}",
        )
    return fleet


def cached_tokens(response: dict) -> int:
    """vLLM's usage.prompt_tokens_details.cached_tokens (needs --enable-prompt-tokens-details)."""
    details = response["usage"].get("prompt_tokens_details")
    assert details is not None, "vLLM sent no prompt_tokens_details"
    return details["cached_tokens"] or 0


def text_prompt(tag: str, words: int) -> str:
    """A prompt that no other prompt shares a first block with (its tag leads)."""
    vocab = ("cache", "block", "router", "engine", "prefix", "token", "event", "hash", "agent")
    body = " ".join(f"{vocab[(i * 7 + len(tag)) % len(vocab)]}{i}" for i in range(words))
    return f"[{tag}] {body}"
