"""The router and its engines must agree on the model: a request names a model the engine serves,
and the router tokenizes prompts into the ids the engine caches them under.

Each engine is asked what vLLM and kvmesh both answer: GET /v1/models (each card's ``id``, and
``root``, the model it was loaded from) and POST /tokenize of a few probe texts (plain text,
whitespace, non-ASCII, the tokenizer's special tokens, once with special tokens added). An
engine is refused when --served-model-name is given and it does not list it, when an endpoints
file lists a model for it that it does not list, or when it splits a probe into other ids than
the router's tokenizer does (another vocabulary, other special tokens, another BOS rule): its
prefix keys would never match. At start a refused engine stops the router (EngineModelMismatch,
exit 2, with what to change); an engine unreachable then, or back after it was lost, is judged
when a scrape next reaches it, and a refused one stays out of rotation (Endpoint.model_mismatch).
An engine that answers no /v1/models or /tokenize is not judged on what it does not say;
``engine_model_check`` off skips all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import aiohttp

from kvmesh.protocol.tokenizer import DEFAULT_MODEL_NAME, PROBES, encode

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint, EndpointPool

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 5.0  # the start's check of every reachable engine, at most
RETRY_S = 2.0  # an engine that did not answer is asked again at most this often
SHOWN_IDS = 12  # token ids quoted in a refusal
OVERRIDE = "--no-engine-model-check routes to it anyway"


class EngineModelMismatch(Exception):
    """The router refuses to start: an engine serves another model than the router expects."""


class _NoAnswer(Exception):
    """The engine did not answer (connection refused, timeout): judged later."""


def probes(tokenizer: Any) -> list[tuple[str, bool, list[int]]]:
    """(text, add_special_tokens, the router's ids) of each probe."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", ()) if t][:8]
    texts = [(text, False) for text in PROBES] + [("Hello world", True)]
    if specials:
        texts.append((" ".join(specials) + " x", False))
    return [(text, special, encode(tokenizer, text, special)) for text, special in texts]


class EngineModelCheck:
    """Judges each engine once it is reachable (again); see the module's invariants."""

    def __init__(self, config, tokenizer: Any, pool: EndpointPool) -> None:
        self.enabled = config.engine_model_check
        self.served_model_name: str | None = config.served_model_name
        self.tokenizer_name = config.tokenizer or f"the embedded {DEFAULT_MODEL_NAME}'s"
        self.authorization = config.upstream_authorization(None)
        self.pool = pool
        self.probes = probes(tokenizer) if self.enabled else []
        self.session: aiohttp.ClientSession | None = None
        self._running: dict[str, asyncio.Task] = {}  # url -> its check in flight
        self._asked_at: dict[str, float] = {}  # url -> when it last went unanswered
        # url -> the longest max_model_len its /v1/models cards give, once judged
        self.context_lengths: dict[str, int] = {}

    def largest_context(self) -> int | None:
        """The largest max_model_len among the endpoints in rotation: no prompt needing more
        tokens fits any of them. None when one of them has not said (or none is in rotation)."""
        most = 0
        lengths = self.context_lengths
        for e in self.pool.candidates():
            n = lengths.get(e.url)
            if n is None:
                return None
            most = n if n > most else most
        return most or None

    async def start(self, session: aiohttp.ClientSession) -> None:
        """The start's check of every endpoint the first scrape reached: EngineModelMismatch
        naming the first refused engine and what to change."""
        self.session = session
        reached = [e for e in self.pool.endpoints.values() if e.healthy]
        if not self.enabled:
            for e in self.pool.endpoints.values():
                e.model_checked = True
            return
        urls = list(dict.fromkeys(e.url for e in reached))
        judged = (asyncio.wait_for(self._judge(url), START_TIMEOUT_S) for url in urls)
        verdicts = await asyncio.gather(*judged, return_exceptions=True)
        for url, verdict in zip(urls, verdicts, strict=True):
            if isinstance(verdict, str):
                raise EngineModelMismatch(f"{verdict} ({OVERRIDE})")
            if isinstance(verdict, BaseException):  # unanswered (or timed out): judged when
                self._asked_at[url] = time.monotonic()  # a scrape next reaches it
                continue
            for e in self._at(url):
                e.model_checked = True

    def later(self, e: Endpoint) -> None:
        """A scrape reached e, not judged yet: judge its server in the background."""
        if not self.enabled:
            e.model_checked = True
            return
        if self.session is None or e.url in self._running:
            return
        if time.monotonic() - self._asked_at.get(e.url, -RETRY_S) < RETRY_S:
            return
        self._running[e.url] = asyncio.create_task(self._judge_later(e.url))

    async def stop(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _at(self, url: str) -> list[Endpoint]:
        return [e for e in self.pool.endpoints.values() if e.url == url]

    async def _judge_later(self, url: str) -> None:
        try:
            verdict = await self._judge(url)
        except _NoAnswer:
            self._asked_at[url] = time.monotonic()
            return
        finally:
            self._running.pop(url, None)
        for e in self._at(url):
            was = e.model_mismatch
            e.model_checked, e.model_mismatch = True, verdict is not None
            if verdict is not None and not was:
                logger.error("endpoint %s out of rotation: %s (%s)", e.name, verdict, OVERRIDE)
            elif was and verdict is None:
                logger.warning(
                    "endpoint %s now serves the router's model: back in rotation", e.name
                )

    async def _judge(self, url: str) -> str | None:
        """What is wrong with the engine at url (None: nothing it says)."""
        ids, root = await self._models(url)
        if ids is not None:
            wrong = self._names(url, ids)
            if wrong:
                return wrong
        name = self.served_model_name
        model = name if ids and name in ids else (ids[0] if ids else None)
        served = root or model or "its model"
        for text, special, ours in self.probes:
            theirs = await self._tokenize(url, model, text, special)
            if theirs is None:
                return None  # no /tokenize: its tokens are not judged
            if theirs != ours:
                how = " with special tokens" if special else ""
                return (
                    f"engine {url} ({served}) tokenizes {text!r}{how} as {_ids(theirs)} but the "
                    f"router's tokenizer ({self.tokenizer_name}) as {_ids(ours)}, so no prefix "
                    f"key would match its cache: start the router with --model set to a "
                    f"local copy of {served}"
                )
        return None

    def _names(self, url: str, ids: list[str]) -> str | None:
        served = ", ".join(repr(i) for i in ids) or "no model"
        name = self.served_model_name
        if name and name not in ids:
            return (
                f"engine {url} serves {served} (GET /v1/models), not {name!r} that "
                f"--served-model-name names: give the router --served-model-name "
                f"{ids[0] if ids else '...'} or start the engine with --served-model-name {name}"
            )
        for e in self._at(url):
            for listed in e.models:
                if listed not in ids:
                    return (
                        f"the endpoints file lists model {listed!r} for {e.name}, but the engine "
                        f"serves {served} (GET /v1/models): correct its models entry"
                    )
        return None

    async def _models(self, url: str) -> tuple[list[str] | None, str | None]:
        """(the model ids, the first card's root) from GET /v1/models; (None, None) when the
        engine answers without them."""
        doc = await self._call("GET", f"{url}/v1/models", None)
        cards = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(cards, list):
            self.context_lengths.pop(url, None)
            return None, None
        lengths = [c.get("max_model_len") for c in cards if isinstance(c, dict)]
        lengths = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        if lengths and len(lengths) == len(cards):
            self.context_lengths[url] = max(lengths)
        else:  # a card that does not say: no bound from this engine
            self.context_lengths.pop(url, None)
        ids = [c["id"] for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
        root = cards[0].get("root") if cards and isinstance(cards[0], dict) else None
        return ids, root if isinstance(root, str) and root else None

    async def _tokenize(self, url: str, model, text: str, special: bool) -> list[int] | None:
        body: dict = {"prompt": text, "add_special_tokens": special}
        if model:
            body["model"] = model
        doc = await self._call("POST", f"{url}/tokenize", body)
        tokens = doc.get("tokens") if isinstance(doc, dict) else None
        return tokens if isinstance(tokens, list) else None

    async def _call(self, method: str, url: str, body: dict | None) -> Any:
        """The JSON answer of a 200; None for any other answer; _NoAnswer for none at all."""
        assert self.session is not None
        headers = {"Authorization": self.authorization} if self.authorization else {}
        try:
            async with self.session.request(
                method, url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=3.0)
            ) as resp:
                if resp.status != 200:
                    return None
                with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                    return await resp.json(content_type=None)
                return None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _NoAnswer(str(exc)) from exc


def _ids(ids: Iterable[int]) -> str:
    ids = list(ids)
    shown = ", ".join(str(i) for i in ids[:SHOWN_IDS])
    return f"[{shown}{', ...' if len(ids) > SHOWN_IDS else ''}]"
