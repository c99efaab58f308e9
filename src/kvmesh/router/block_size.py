"""The KV block size the router keys prompts with: one home that every reader goes through.

Prompts match an engine's cache only when the router hashes them in the engine's blocks, so the
size comes from the engines. Given (``--block-size``) it is fixed: an engine reporting another
size refuses the router's start, and later (joined, restarted) stays out of rotation. Not
given, it is learned: from the engines' /metrics (``vllm:cache_config_info``) at start, where
they must agree, and confirmed by their BlockStored events; while none has reported one,
DEFAULT_BLOCK_SIZE is used and the first size learned later is adopted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.protocol.hashing import DEFAULT_BLOCK_SIZE
from kvmesh.protocol.wording import noun_for, plural

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint
    from kvmesh.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
EVENT_LOG_EVERY = 10.0  # seconds between error lines about one endpoint's dropped events


class BlockSizeMismatch(Exception):
    """The router refuses to start: an engine's block size is not the one it would key with."""


def _engine(e: Endpoint) -> str:
    return e.url if e.name == e.url else f"{e.name} ({e.url})"


@dataclass(slots=True)
class EngineBlockSize:
    """Invariants: ``value`` is ``configured`` when given; else the size learned from the
    engines (``known``), or DEFAULT_BLOCK_SIZE while none reported one. An endpoint reporting
    another size than ``value`` is in ``excluded`` (out of rotation) unless, size learned, no
    other endpoint reports ``value`` any more: then the fleet has moved and ``value`` follows."""

    configured: int | None = None  # --block-size; None: learn it
    metrics: RouterMetrics | None = None
    value: int = DEFAULT_BLOCK_SIZE
    known: bool = False  # value was given or reported by an engine
    reports: dict[str, int] = field(default_factory=dict)  # endpoint name -> its /metrics size
    excluded: dict[str, int] = field(default_factory=dict)  # out of rotation -> its size
    on_change: list[Callable[[int], None]] = field(default_factory=list)  # called with value
    # endpoint -> (monotonic time of its last dropped-events line, events dropped since)
    _event_drops: dict[str, tuple[float, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.configured is not None:  # positive: RouterConfig checked it
            self.value, self.known = self.configured, True
        self._publish()

    def start(self, endpoints: Iterable[Endpoint]) -> None:
        """The start's check, after one /metrics read of every endpoint: BlockSizeMismatch
        when an engine reports another size than the given one, or engines disagree."""
        reported = [e for e in endpoints if e.block_size is not None]
        if self.configured is not None:
            for e in reported:
                if e.block_size != self.configured:
                    raise BlockSizeMismatch(
                        f"engine {_engine(e)} uses block size {e.block_size} but --block-size "
                        f"is {self.configured}: no prefix would ever match; drop --block-size "
                        f"to learn it or set {e.block_size}"
                    )
        elif len({e.block_size for e in reported}) > 1:
            sizes = ", ".join(f"{_engine(e)} uses {e.block_size}" for e in reported)
            raise BlockSizeMismatch(
                f"engines disagree on the KV block size ({sizes}): a prompt's prefix cannot "
                "match on all of them; run them with one --block-size, or route each size "
                "with its own router"
            )
        elif reported:
            self._adopt(reported[0].block_size, f"engine {_engine(reported[0])}")
        else:
            logger.warning(
                "no engine reported its KV block size (vllm:cache_config_info on /metrics): "
                "keying prompts with %d until one does; --block-size sets it",
                self.value,
            )
        for e in reported:
            self.check(e)

    def check(self, e: Endpoint) -> None:
        """Judge the size e's last /metrics read reported (``e.block_size``): sets
        ``e.block_size_mismatch``, which keeps it out of rotation."""
        size = e.block_size
        if size is None:  # it does not say: nothing to refuse it for
            self._admit(e)
            return
        self.reports[e.name] = size
        if size == self.value and self.known:
            self._admit(e)
        elif not self.known:
            self._adopt(size, f"engine {_engine(e)}")
            self._admit(e)
        elif self.configured is None and not any(
            s == self.value for name, s in self.reports.items() if name != e.name
        ):
            self._adopt(size, f"engine {_engine(e)}: no endpoint reports {self.value} any more")
            self._admit(e)
        else:
            self._exclude(e, size)

    def event_ok(self, endpoint: str, size: int | None) -> bool:
        """Whether a BlockStored event keyed in ``size``-token blocks belongs in the index:
        size 0 or missing (old offload connectors' placeholders) is; another size is dropped,
        with an error line per endpoint at most every EVENT_LOG_EVERY seconds."""
        if not size or (size == self.value and self.known):
            return True
        if not self.known:
            self._adopt(size, f"KV events of {endpoint}")
            return True
        if self.metrics is not None:
            self.metrics.kv_events_dropped.labels(endpoint, "block_size").inc()
        now = time.monotonic()
        logged_at, dropped = self._event_drops.get(endpoint, (-EVENT_LOG_EVERY, 0))
        if now - logged_at < EVENT_LOG_EVERY:
            self._event_drops[endpoint] = (logged_at, dropped + 1)
            return False
        logger.error(
            "dropped %s of %s: block size %d, the router keys prompts with %d, so %s never match",
            plural(dropped + 1, "BlockStored event"), endpoint, size, self.value,
            noun_for(dropped + 1, "it could", "they could"),
        )  # fmt: skip
        self._event_drops[endpoint] = (now, 0)
        return False

    def forget(self, name: str) -> None:
        """The endpoint was removed. (One that is lost keeps its last report: a learned size
        does not follow the engines still up while it is briefly away.)"""
        self.reports.pop(name, None)
        self.excluded.pop(name, None)
        self._event_drops.pop(name, None)
        if self.metrics is not None:
            with contextlib.suppress(KeyError):  # never flagged
                self.metrics.block_size_mismatch.remove(name)

    def _adopt(self, size: int, source: str) -> None:
        old, was_known = self.value, self.known
        self.value, self.known = size, True
        if was_known:
            logger.warning("KV block size %d (was %d), learned from %s", size, old, source)
        else:
            logger.info("KV block size %d, learned from %s", size, source)
        self._publish()
        if size != old:
            for changed in self.on_change:
                changed(size)

    def _admit(self, e: Endpoint) -> None:
        if self.excluded.pop(e.name, None) is not None:
            logger.warning(
                "endpoint %s now uses block size %s as the router: back in rotation",
                e.name, e.block_size if e.block_size is not None else "(unreported)",
            )  # fmt: skip
        e.block_size_mismatch = False
        self._flag(e.name, 0)

    def _exclude(self, e: Endpoint, size: int) -> None:
        if self.excluded.get(e.name) != size:
            self.excluded[e.name] = size
            how = "--block-size is" if self.configured is not None else "the router learned"
            logger.error(
                "endpoint %s out of rotation: it uses block size %d but %s %d, so no prefix "
                "would ever match there; restart it with --block-size %d",
                _engine(e), size, how, self.value, self.value,
            )  # fmt: skip
        e.block_size_mismatch = True
        self._flag(e.name, 1)

    def _flag(self, name: str, mismatched: int) -> None:
        if self.metrics is not None:
            self.metrics.block_size_mismatch.labels(name).set(mismatched)

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.block_size.set(self.value)
