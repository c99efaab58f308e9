"""Endpoints and what the router knows of each: health, load scraped from /metrics, requests in
flight through this router, and where its KV events are published. The pool keeps them fresh and
applies outlier detection (router.outlier) to the requests that fail."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import yaml

from kvmesh.protocol.prom import parse_block_size, parse_engine_load
from kvmesh.protocol.zmq_events import offset_endpoint
from kvmesh.router.outlier import OutlierDetection, ejection_ended, forget_ejections
from kvmesh.router.page_reader import PageError, PageReader, PageTimeout

logger = logging.getLogger(__name__)
LOST_AFTER = 3
MAX_BACKOFF = 2.0  # an unreachable endpoint is checked again at least this often
START_SCRAPE_TIMEOUT = 3.0  # seconds the router's start waits for the first /metrics reads
SCRAPE_TIMEOUT = 2.0  # seconds one /metrics read may take
RANKS_EVERY = 10.0  # seconds between reads of a server's data-parallel ranks off its page


@dataclass(slots=True, eq=False)
class Endpoint:
    url: str  # base URL, e.g. http://10.0.0.5:8000
    name: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    kv_events: str | None = None  # ZMQ endpoint to subscribe to; "auto": ask /kv_event_sources
    kv_events_replay: str | None = None  # its replay socket, when kv_events is given, not "auto"
    dp_rank: int | None = None  # a data-parallel rank of a server: sent as X-data-parallel-rank
    healthy: bool = True
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    in_flight_tokens: int = 0
    pending_prefill_tokens: int = 0  # uncached prompt tokens of forwarded requests not answered yet
    failures: int = 0  # failed checks (connects, scrapes) in a row
    timed_out: bool = False  # the last failed check timed out (a loaded host), none refused
    retry_at: float = 0.0
    last_scrape: float = 0.0
    errors: int = 0  # requests failed in a row (5xx answers, timeouts): the outlier count
    ejected_until: float = 0.0  # monotonic; out of rotation until then
    ejected: bool = False  # an ejection whose end the scrape loop has not yet seen
    times_ejected: int = 0  # the next ejection lasts base time x this, decaying while in service
    block_size: int | None = None  # as its /metrics says (vllm:cache_config_info); None: unsaid
    block_size_mismatch: bool = False  # not the router's block size: out of rotation
    model_checked: bool = False  # router.engine_model judged what it serves since it was reached
    model_mismatch: bool = False  # not the router's model or tokenizer: out of rotation

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.name = self.name or self.url

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    def mark_failure(self, now: float, timed_out: bool = False) -> None:
        """Unreachable: checked again after 0.25 s doubling to MAX_BACKOFF, so an engine that
        restarted is back in rotation within about MAX_BACKOFF of answering /metrics."""
        self.failures += 1
        self.healthy, self.timed_out = False, timed_out
        self.retry_at = now + min(MAX_BACKOFF, 0.25 * 2 ** min(self.failures - 1, 8))

    def mark_success(self) -> None:
        self.failures = 0
        self.healthy, self.timed_out = True, False


def data_parallel_ranks(base: Endpoint, size: int) -> list[Endpoint]:
    """One scheduling endpoint per data-parallel rank of a server (vLLM's internal load
    balancer): named ``<name>#dp<rank>``, pinned by the X-data-parallel-rank header, with the
    server's KV-event endpoint offset by the rank as vLLM offsets it."""
    return rank_endpoints(base, range(size)) if size > 1 else [base]


def rank_endpoints(base: Endpoint, ranks) -> list[Endpoint]:
    out = []
    for rank in ranks:
        events, replay = base.kv_events, base.kv_events_replay
        if events and events != "auto":
            events = offset_endpoint(events, rank)
            replay = offset_endpoint(replay, rank) if replay else None
        name = f"{base.name}#dp{rank}"
        out.append(
            Endpoint(base.url, name, dict(base.labels), base.models, events, replay, dp_rank=rank)
        )
    return out


_ENGINE_LABEL = re.compile(r'^vllm:num_requests_(?:waiting|running)\{[^}]*engine="(\d+)"', re.M)


def page_ranks(text: str) -> list[int]:
    """The data-parallel ranks a vLLM /metrics page reports (its engine="<rank>" series)."""
    return sorted({int(r) for r in _ENGINE_LABEL.findall(text)})


def load_endpoints_file(path: str | Path) -> list[Endpoint]:
    """YAML or JSON: a list of URLs, or of {url, name, labels, models, kv_events,
    kv_events_replay, data_parallel_size}."""
    data = yaml.safe_load(Path(path).read_text()) or []
    if isinstance(data, dict):
        data = data.get("endpoints", [])
    out = []
    for item in data:
        if isinstance(item, str):
            out.append(Endpoint(item))
        elif isinstance(item, dict) and "url" in item:
            base = Endpoint(
                item["url"],
                item.get("name", ""),
                {str(k): str(v) for k, v in (item.get("labels") or {}).items()},
                tuple(item.get("models") or ()),
                item.get("kv_events"),
                item.get("kv_events_replay"),
            )
            size = item.get("data_parallel_size", 1)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{path}: data_parallel_size must be a positive integer")
            out += data_parallel_ranks(base, size)
        else:
            raise ValueError(f"{path}: each endpoint is a URL or a mapping with 'url'")
    return out


def rank_page(text: str, rank: int | None) -> str:
    """The lines of a /metrics page about one data-parallel rank (vLLM labels each engine
    core's series engine="<rank>"); the whole page when it has none for that rank."""
    if rank is None:
        return text
    label = f'engine="{rank}"'
    lines = [line for line in text.splitlines() if label in line]
    return "\n".join(lines) if lines else text


class EndpointPool:
    """The live set of endpoints, kept fresh by background tasks on the router's event loop.
    Invariant: candidates() are the healthy (reachable) endpoints not ejected at that moment,
    not keyed in another block size than the router's (router.block_size judges each scrape's)
    and not serving another model (router.engine_model judges each once reached), or in panic
    (too few of those: outlier.OutlierDetection.rotation) all of these but the refused; a scrape
    never ends an ejection early, except for an endpoint that was gone LOST_AFTER checks (a
    restarted engine starts afresh)."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        scrape_interval: float = 0.1,
        endpoints_file: str | None = None,
        on_removed=None,
        discover_data_parallel: bool = True,
        outlier: OutlierDetection | None = None,
    ) -> None:
        self.endpoints: dict[str, Endpoint] = {e.name: e for e in endpoints}
        self.scrape_interval = scrape_interval
        self.endpoints_file = endpoints_file
        self.on_removed = on_removed or (lambda name: None)
        self.on_added = lambda endpoint: None
        self.on_lost = lambda name: None  # an endpoint failed LOST_AFTER checks in a row
        self.check_block_size = lambda endpoint: None  # after each scrape that read its page
        self.check_model = lambda endpoint: None  # after each scrape that reached one unjudged
        self.metrics = None  # RouterMetrics: ejections and re-admissions are counted there
        self.discover_data_parallel = discover_data_parallel
        self.outlier = outlier or OutlierDetection()
        self._file_mtime = 0.0
        self._tasks: list[asyncio.Task] = []
        self.reader = PageReader()  # the /metrics reads, a keep-alive connection per server
        self._ranks_read: dict[str, float] = {}  # server -> when its ranks were last read
        self.panic = False  # too few endpoints in rotation: requests go to all that answer

    def add(self, e: Endpoint) -> None:
        """e joins the pool (its KV events, indexes and connections follow via on_added)."""
        self.endpoints[e.name] = e
        self.on_added(e)

    def remove(self, name: str) -> None:
        """The endpoint of that name leaves the pool (and what on_added set up, via on_removed)."""
        del self.endpoints[name]
        self.on_removed(name)

    def candidates(self) -> list[Endpoint]:
        routable, panic = self.outlier.rotation(self.endpoints.values(), time.monotonic())
        if panic is not self.panic:
            self.panic = panic
            if panic:
                logger.warning(
                    "panic: fewer than %g%% of the endpoints in rotation; routing over all %d "
                    "that answer, ejected or not", self.outlier.healthy_panic_threshold,
                    len(routable),
                )  # fmt: skip
            else:
                logger.info("panic over: enough endpoints in rotation again")
            if self.metrics is not None:
                self.metrics.healthy_panic.set(1 if panic else 0)
        return routable

    def unreachable(self, e: Endpoint, timed_out: bool = False) -> None:
        """A connect or a scrape failed (``timed_out``: no answer in time, not refused): out of
        rotation until a scrape succeeds; gone (what it cached no longer counted on) at the
        LOST_AFTER-th failure in a row."""
        was = e.healthy
        e.mark_failure(time.monotonic(), timed_out)
        if was:
            logger.warning("endpoint %s unreachable", e.name)
            self._count("ejections", e.name, "unreachable")
        if e.failures == LOST_AFTER:
            self.on_lost(e.name)

    def request_failed(self, e: Endpoint, reason: str) -> None:
        """A request failed at e (reason: 5xx or timeout): outlier detection may eject it."""
        span = self.outlier.request_failed(e, self.endpoints.values(), time.monotonic())
        if span:
            logger.warning(
                "endpoint %s ejected for %.3g s: %d requests failed in a row (last: %s)",
                e.name, span, self.outlier.consecutive_errors, reason,
            )  # fmt: skip
            self._count("ejections", e.name, reason)

    def _count(self, counter: str, name: str, reason: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, counter).labels(name, reason).inc()

    async def scrape_once(self, timeout: float = START_SCRAPE_TIMEOUT) -> None:
        """One /metrics read of every endpoint, given up after ``timeout`` seconds: the
        router's start learns health, load, data-parallel ranks and block sizes from it."""
        if self.endpoints_file:
            self._reload_file()
        servers: dict[str, list[Endpoint]] = {}
        for e in self.endpoints.values():
            servers.setdefault(e.url, []).append(e)
        reads = asyncio.gather(*(self.scrape(*group) for group in servers.values()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reads, timeout)

    async def start(self) -> None:
        if self.endpoints_file:
            self._reload_file()
        self._tasks.append(asyncio.create_task(self._scrape_loop()))
        if self.endpoints_file:
            self._tasks.append(asyncio.create_task(self._watch_file()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.reader.close()

    def _reload_file(self) -> None:
        path = Path(self.endpoints_file)
        try:
            mtime = path.stat().st_mtime
            if mtime == self._file_mtime:
                return
            fresh = {e.name: e for e in load_endpoints_file(path)}
        except (OSError, ValueError, yaml.YAMLError) as exc:
            logger.warning("endpoints file %s not loaded: %s", path, exc)
            return
        self._file_mtime = mtime
        for name in list(self.endpoints):
            if name not in fresh:
                self.remove(name)
        for name, e in fresh.items():
            if name not in self.endpoints:
                self.add(e)
        logger.info("endpoints: %s", ", ".join(self.endpoints))

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._reload_file()

    async def _scrape_loop(self) -> None:
        while True:
            now = time.monotonic()
            due: dict[str, list[Endpoint]] = {}  # one read per server serves all its ranks
            for e in self.endpoints.values():
                if e.healthy or e.retry_at <= now:
                    due.setdefault(e.url, []).append(e)
                if ejection_ended(e, now):
                    logger.info("endpoint %s back from ejection", e.name)
                    self._count("readmissions", e.name, "ejection_expired")
            if due:
                await asyncio.gather(*(self.scrape(*group) for group in due.values()))
            await asyncio.sleep(self.scrape_interval)

    async def scrape(self, *endpoints: Endpoint) -> None:
        """One /metrics read of a server doubles as the health check of each of its ranks."""
        url = endpoints[0].url
        try:
            text = await self.reader.read(url + "/metrics", SCRAPE_TIMEOUT)
        except PageError as exc:
            self._ranks_read.pop(url, None)
            for e in endpoints:
                self.unreachable(e, isinstance(exc, PageTimeout))
            return
        now = time.monotonic()
        if (
            self.discover_data_parallel
            and endpoints[0].dp_rank is None
            and now - self._ranks_read.get(url, -RANKS_EVERY) >= RANKS_EVERY
        ):  # read when it is reached again, and every RANKS_EVERY seconds: not every scrape
            self._ranks_read[url] = now
            ranks = page_ranks(text)
            if len(ranks) > 1:
                endpoints = self._split(endpoints, ranks)
        for e in endpoints:
            if not e.healthy:
                logger.info("endpoint %s healthy again", e.name)
                self._count("readmissions", e.name, "reachable")
                if e.failures >= LOST_AFTER:  # it was gone: a restarted engine starts afresh
                    forget_ejections(e)
                    e.model_checked = False  # and may serve another model
            e.mark_success()
            page = rank_page(text, e.dp_rank)
            e.waiting, e.running, e.kv_usage = parse_engine_load(page)
            e.last_scrape = now
            # kvmesh's cache_config_info has no engine label: the whole page's then
            e.block_size = parse_block_size(page) or parse_block_size(text)
            self.check_block_size(e)
            if not e.model_checked:
                self.check_model(e)

    def _split(self, servers: tuple[Endpoint, ...], ranks: list[int]) -> list[Endpoint]:
        """A server found to host several data-parallel ranks becomes one endpoint per rank."""
        out: list[Endpoint] = []
        for base in servers:
            if self.endpoints.get(base.name) is not base:
                continue
            self.remove(base.name)
            for e in rank_endpoints(base, ranks):
                self.add(e)
                out.append(e)
            logger.info("endpoint %s serves data-parallel ranks %s", base.name, ranks)
        return out
