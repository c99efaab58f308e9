"""KV event ingestion: one ZMQ SUB per endpoint on the router's event loop, feeding the precise
index, which the publisher's replay socket keeps whole: on subscribing (a new router, or a
subscription started again) the buffered history is replayed; a sequence gap, or a quiet spell
that may hide a lost last batch, is repaired from it; a publisher whose sequence began again (its
engine restarted) has the endpoint's entries cleared, as AllBlocksCleared would, then replayed.
BlockStored events keyed in another block size than the router's never reach the index
(router.block_size). Where each endpoint's publisher is, and which subscriptions this router
cannot take (``refused``: the router is not ready while any is): router.event_sources."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from dataclasses import dataclass, field

import aiohttp
import zmq
import zmq.asyncio

from kvmesh.protocol.kv_events import BlockStored, KVEventBatch, decode_batch
from kvmesh.protocol.zmq_events import END_SEQ
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.event_sources import SubscriptionBinds, SubscriptionRefused, discover

logger = logging.getLogger(__name__)
REPLAY_WAIT = 2.0  # seconds a replay socket may stay silent before the replay is given up
RETRY_AFTER = 1.0  # after a replay was given up, live batches are applied as they come this long
RECENT = 4096  # the last batches of a replay remembered, to know their live copies
REBIND_AFTER = 2.0  # seconds between tries to bind a refused subscription's address


@dataclass(slots=True)
class _Feed:
    """One endpoint's event stream as the router holds it. Invariant: the index holds the
    effect of the publisher's batches up to seq ``last``, all that its replay buffer had."""

    since: float  # monotonic: following (again) since, for the warm-up time
    last: int | None = None  # seq of the last batch applied; None: nothing known yet
    last_ts: float = 0.0  # its timestamp: tells it from a restarted publisher's batch at that seq
    recent: dict[int, float] = field(default_factory=dict)  # seq -> ts, from the last replay
    warm: bool = False
    epoch: int = 0  # bumped by resync: a replay fetched across it is dropped
    retry_at: float = 0.0  # monotonic: no replay is asked before this
    silent: bool = False  # the last replay asked went unanswered (warned once)


class EventIngest:
    def __init__(
        self,
        index,
        session: aiohttp.ClientSession | None,
        metrics=None,
        check_interval: float = 2.0,
        block_size=None,
    ) -> None:
        self.index = index
        self.session = session
        self.metrics = metrics  # RouterMetrics, or None
        self.block_size = block_size  # router.block_size.EngineBlockSize; None: all accepted
        self.check_interval = check_interval  # quiet seconds after which the replay is checked
        self.ctx = zmq.asyncio.Context.instance()
        self.tasks: dict[str, asyncio.Task] = {}
        self.feeds: dict[str, _Feed] = {}
        self.lag_seconds = 0.0  # receive time minus the batch's timestamp, last live one seen
        self.batches = 0
        self.gaps_repaired = 0
        self.restarts = 0
        self.binds = SubscriptionBinds()
        self.refused = self.binds.refused  # endpoint -> why its events cannot be taken now

    def watch(self, endpoint: Endpoint) -> None:
        if endpoint.kv_events and endpoint.name not in self.tasks:
            self.feeds[endpoint.name] = _Feed(time.monotonic())
            self.tasks[endpoint.name] = asyncio.create_task(self._run(endpoint))
            if self.metrics is not None:
                self.metrics.kv_index_warm.labels(endpoint.name).set(0)
                self.metrics.kv_events_refused.labels(endpoint.name).set(0)

    def forget(self, name: str) -> None:
        task = self.tasks.pop(name, None)
        if task is not None:
            task.cancel()
        self.feeds.pop(name, None)
        self.binds.release(name, forget=True)
        self.index.remove_endpoint(name)
        if self.metrics is not None:
            m = self.metrics
            for gauge in (m.kv_index_warm, m.kv_index_warm_seconds, m.kv_events_refused):
                with contextlib.suppress(KeyError):
                    gauge.remove(name)

    def all_warm(self) -> bool:
        return all(feed.warm for feed in self.feeds.values())

    def resync(self, name: str) -> None:
        """The endpoint's entries were dropped (it was lost): replay its whole history anew."""
        feed = self.feeds.get(name)
        if feed is not None:
            feed.last, feed.epoch, feed.since = None, feed.epoch + 1, time.monotonic()
            feed.recent.clear()
            self._set_warm(name, feed, False)

    async def stop(self) -> None:
        for name in list(self.tasks):
            task = self.tasks.pop(name)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, e: Endpoint) -> None:
        """Follow one endpoint's events; a failure is logged and the subscription retried."""
        while True:
            try:
                await self._follow(e)
            except asyncio.CancelledError:
                raise
            except SubscriptionRefused as exc:  # logged once per reason, retried quietly
                self._set_refused(e.name, str(exc))
                await asyncio.sleep(REBIND_AFTER)
            except Exception as exc:  # a bad address, a socket error: never silently gone
                logger.warning("KV events of %s: %s; retrying in 1 s", e.name, exc)
                await asyncio.sleep(1.0)

    async def _follow(self, e: Endpoint) -> None:
        """Subscribe first, then replay: batches published meanwhile wait in the socket and
        are dropped as copies of replayed ones, or fill what the replay ended before."""
        sub_ep, replay_ep, topic = await discover(self.session, e)
        feed = self.feeds.setdefault(e.name, _Feed(time.monotonic()))
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # nothing dropped while a replay is read
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        wait_ms = int(self.check_interval * 1000)
        try:
            # a publisher that binds is connected to; one that connects needs us to bind
            self.binds.attach(sock, e.name, sub_ep)
            self._set_refused(e.name, None)
            if replay_ep:
                await self._sync(e, feed, replay_ep, "start" if feed.last is None else "reconnect")
            else:  # no history to be had: warm from here
                self._set_warm(e.name, feed, True)
            while True:
                if not await sock.poll(wait_ms):
                    if replay_ep:  # quiet: was the last batch lost, or did the engine restart?
                        await self._sync(e, feed, replay_ep, "gap")
                    continue
                frames = await sock.recv_multipart()
                if len(frames) < 3 or len(frames[-2]) != 8:
                    continue
                seq = int.from_bytes(frames[-2], "big")
                if feed.last is not None and seq == feed.last + 1:
                    self._apply(e, feed, seq, frames[-1], live=True)
                else:
                    await self._out_of_order(e, feed, replay_ep, seq, frames[-1])
        finally:
            self.binds.release(e.name)
            sock.close()

    async def _out_of_order(
        self, e: Endpoint, feed: _Feed, replay_ep: str | None, seq: int, payload: bytes
    ) -> None:
        """A live batch that does not follow the last one: a copy of a replayed batch, the
        first after a gap, or the first of a restarted publisher. While a replay is owed (its
        socket was silent) batches are applied, but the feed stays where it was, so that the
        next one asks again."""
        batch = self._decode(e, payload)
        reason = "start" if feed.last is None else "gap"
        if feed.last is not None and seq <= feed.last:
            if batch is not None and feed.recent.get(seq) == batch.ts:
                return  # a live copy of a replayed batch
            reason = "restart"
            self._clear(e, feed)
        synced = False
        if replay_ep and time.monotonic() >= feed.retry_at:
            synced = await self._sync(e, feed, replay_ep, reason)
        if feed.last is None or seq > feed.last:  # the replay did not bring it
            self._apply(e, feed, seq, batch, live=True, advance=synced or not replay_ep)

    async def _sync(self, e: Endpoint, feed: _Feed, replay_ep: str, reason: str) -> bool:
        """Bring the index up to the publisher's replay buffer: from ``last`` (inclusive) when
        known, where the batch found must be the one applied (same seq and timestamp); else
        the publisher restarted, or its buffer moved past ours: the endpoint's entries are
        cleared and all is replayed from 0. False when the replay socket stayed silent."""
        epoch = feed.epoch
        got = await self._fetch(e, feed, replay_ep, feed.last or 0)
        if got is None or feed.epoch != epoch:
            return False
        if feed.last is not None:
            first = self._decode(e, got[0][1]) if got and got[0][0] == feed.last else None
            if first is not None and first.ts == feed.last_ts:
                got = got[1:]
            else:
                self._clear(e, feed)
                reason = "restart"
                got = await self._fetch(e, feed, replay_ep, 0)
                if got is None or feed.epoch != epoch:
                    return False
        feed.recent.clear()
        for seq, payload in got:
            self._apply(e, feed, seq, payload, live=False)
        if len(feed.recent) > RECENT:  # only the last ones can have live copies still queued
            feed.recent = dict(list(feed.recent.items())[-RECENT:])
        if got or reason in ("start", "reconnect", "restart"):
            self._count_replay(e.name, reason, len(got))
        self._set_warm(e.name, feed, True)
        return True

    async def _fetch(
        self, e: Endpoint, feed: _Feed, replay_ep: str, start: int
    ) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered (seq, payload) from start on; None when it stayed silent."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(replay_ep)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", struct.pack(">Q", start)])
            while True:
                if not await sock.poll(int(REPLAY_WAIT * 1000)):
                    if not feed.silent:
                        logger.warning("no KV event replay from %s (%s)", e.name, replay_ep)
                    feed.retry_at, feed.silent = time.monotonic() + RETRY_AFTER, True
                    return None
                frames = await sock.recv_multipart()
                if len(frames) < 2:
                    continue
                seq_raw, payload = frames[-2], frames[-1]
                if not payload or seq_raw == END_SEQ:
                    feed.silent = False
                    return out
                out.append((int.from_bytes(seq_raw, "big"), payload))
                if len(out) % 256 == 0:  # a long replay lets answers in flight stream meanwhile
                    await asyncio.sleep(0)
        finally:
            sock.close()

    def _decode(self, e: Endpoint, payload: bytes) -> KVEventBatch | None:
        try:
            return decode_batch(payload)
        except ValueError:
            logger.warning("undecodable KV event batch from %s", e.name)
            return None

    def _apply(
        self,
        e: Endpoint,
        feed: _Feed,
        seq: int,
        batch: bytes | KVEventBatch | None,
        live: bool,
        advance: bool = True,
    ) -> None:
        """Apply batch seq (an undecodable one is passed over); unless ``advance`` is False,
        the feed moves to seq."""
        if isinstance(batch, bytes):
            batch = self._decode(e, batch)
        if batch is not None:
            self.index.apply(e.name, self._same_block_size(e, batch))
            if live:
                self.lag_seconds = max(0.0, time.time() - batch.ts)
                self.batches += 1
            else:
                feed.recent[seq] = batch.ts
        if advance:
            feed.last, feed.last_ts = seq, batch.ts if batch is not None else -1.0

    def _same_block_size(self, e: Endpoint, batch: KVEventBatch) -> KVEventBatch:
        """The batch without its BlockStored events of another block size than the router's:
        their hashes chain other blocks than the router's keys, so they could never match."""
        judge = self.block_size
        if judge is None:
            return batch
        kept = [
            ev
            for ev in batch.events
            if type(ev) is not BlockStored or judge.event_ok(e.name, ev.block_size)
        ]
        if len(kept) == len(batch.events):
            return batch
        return KVEventBatch(batch.ts, kept, batch.data_parallel_rank)

    def _clear(self, e: Endpoint, feed: _Feed) -> None:
        """The publisher restarted: what it held before is gone (AllBlocksCleared)."""
        logger.warning("KV event publisher of %s restarted: its entries are cleared", e.name)
        self.index.remove_endpoint(e.name)
        feed.last = None
        feed.recent.clear()
        self.restarts += 1

    def _count_replay(self, name: str, reason: str, batches: int) -> None:
        if reason == "gap":
            self.gaps_repaired += 1
        if self.metrics is not None:
            self.metrics.kv_event_replays.labels(name, reason).inc()
            self.metrics.kv_event_replayed_batches.labels(name).inc(batches)

    def _set_refused(self, name: str, why: str | None) -> None:
        """Record whether the endpoint's subscription is refused (None: taken)."""
        if self.binds.note(name, why) and self.metrics is not None:
            self.metrics.kv_events_refused.labels(name).set(0 if why is None else 1)

    def _set_warm(self, name: str, feed: _Feed, warm: bool) -> None:
        if feed.warm == warm:
            return
        feed.warm = warm
        if self.metrics is not None:
            self.metrics.kv_index_warm.labels(name).set(1 if warm else 0)
            if warm:
                seconds = time.monotonic() - feed.since
                self.metrics.kv_index_warm_seconds.labels(name).set(seconds)
