"""Workloads of `kvmesh bench spec`: agentic edit tasks (a file shown to the model, to be returned
whole with one small change: the case prompt lookup and draft heads are built for) and plain chat
(short questions, where drafts have little to copy). Chat messages for /v1/chat/completions,
the same list on every call: nothing here depends on time, randomness or the environment."""

from __future__ import annotations

from dataclasses import dataclass

EDIT_SYSTEM = (
    "You are a careful coding assistant. When asked to edit a file, reply with the complete "
    "edited file in one code block: copy every line you do not change exactly."
)

RETRY_PY = '''"""Retry helpers for flaky network calls."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def backoff_delays(attempts, base=0.5, factor=2.0, jitter=0.1):
    delays = []
    delay = base
    for _ in range(attempts):
        spread = delay * jitter
        delays.append(delay + random.uniform(-spread, spread))
        delay *= factor
    return delays


def retry_call(fn: Callable, attempts=5, base=0.5, retry_on=(ConnectionError, TimeoutError)):
    """Call fn until it succeeds or the attempts run out."""
    last_error = None
    for delay in [0.0, *backoff_delays(attempts - 1, base)]:
        if delay:
            time.sleep(delay)
        try:
            return fn()
        except retry_on as exc:
            last_error = exc
            log.warning("call failed: %s; retrying in %.2f s", exc, delay)
    raise RuntimeError(f"gave up after {attempts} attempts") from last_error


def is_transient(status_code):
    return status_code in (408, 429, 500, 502, 503, 504)


def fetch_json(session, url, timeout=10.0, attempts=3):
    """GET url and decode its JSON body, retrying transient failures."""

    def once():
        resp = session.get(url, timeout=timeout)
        if is_transient(resp.status_code):
            raise ConnectionError(f"{url}: HTTP {resp.status_code}")
        resp.raise_for_status()
        return resp.json()

    return retry_call(once, attempts=attempts)
'''

CACHE_PY = '''"""A small LRU cache with per-entry expiry."""

from __future__ import annotations

import time
from collections import OrderedDict


class TTLCache:
    def __init__(self, capacity=128, ttl_seconds=300.0):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.ttl_seconds = ttl_seconds
        self._items = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        entry = self._items.get(key)
        if entry is None:
            self.misses += 1
            return default
        value, expires_at = entry
        if expires_at < time.monotonic():
            del self._items[key]
            self.misses += 1
            return default
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key, value):
        self._items[key] = (value, time.monotonic() + self.ttl_seconds)
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def evict_expired(self):
        now = time.monotonic()
        stale = [k for k, (_, expires_at) in self._items.items() if expires_at < now]
        for key in stale:
            del self._items[key]
        return len(stale)

    def hit_rate(self):
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def __len__(self):
        return len(self._items)
'''

SERVICE_YAML = """# Deployment settings of the orders service.
service:
  name: orders-api
  port: 8080
  workers: 4
  log_level: info
  request_timeout_s: 30

database:
  host: db.internal
  port: 5432
  name: orders
  pool_size: 10
  pool_timeout_s: 5
  ssl: true

cache:
  backend: redis
  url: redis://cache.internal:6379/0
  default_ttl_s: 300
  max_entries: 10000

queue:
  broker: amqp://queue.internal:5672
  prefetch: 16
  retry_limit: 3
  dead_letter: orders.dlq

features:
  bulk_import: false
  price_preview: true
  new_checkout: false

metrics:
  enabled: true
  path: /metrics
  interval_s: 15

tracing:
  enabled: false
  sample_ratio: 0.05
  exporter: otlp
"""

README_MD = """# orders-api

The orders service stores customer orders and publishes an event for every change.

## Requirements

- Python 3.11 or later
- PostgreSQL 14
- Redis 7 for the response cache

## Quick start

```bash
pip install -e .
orders-api migrate
orders-api serve --port 8080
```

## Configuration

Settings are read from `config/service.yaml` and may be overridden by environment variables
named `ORDERS_<SECTION>_<KEY>`, for example `ORDERS_DATABASE_POOL_SIZE=20`.

## Endpoints

| Method | Path              | Purpose                       |
|--------|-------------------|-------------------------------|
| GET    | /orders/{id}      | One order with its lines      |
| POST   | /orders           | Create an order               |
| PATCH  | /orders/{id}      | Change an open order          |
| GET    | /health           | Liveness probe                |

## Testing

```bash
pytest -q
```

Integration tests need a running database; set `ORDERS_DATABASE_HOST` to point at it.

## License

Apache 2.0; see `LICENSE`.
"""

FILES: dict[str, tuple[str, str]] = {  # name -> (code-block language, text)
    "retry.py": ("python", RETRY_PY),
    "cache.py": ("python", CACHE_PY),
    "service.yaml": ("yaml", SERVICE_YAML),
    "README.md": ("markdown", README_MD),
}

EDITS: list[tuple[str, str]] = [  # (file, instruction); the order is the request order
    ("retry.py", "rename the function `retry_call` to `call_with_retries` everywhere"),
    ("cache.py", "add a one-line docstring to the method `put`"),
    ("service.yaml", "change the default `request_timeout_s` from 30 to 60"),
    ("README.md", "rename the project from `orders-api` to `order-service` everywhere"),
    ("retry.py", "change the default of `timeout` in `fetch_json` from 10.0 to 5.0"),
    ("cache.py", "rename the attribute `ttl_seconds` to `ttl_s` everywhere"),
    ("service.yaml", "turn the feature `new_checkout` on"),
    ("README.md", "add a line to Requirements saying RabbitMQ 3.12 is needed for the queue"),
]

CHAT: list[str] = [
    "What is the difference between a list and a tuple in Python?",
    "Explain in a few sentences what a hash table is.",
    "Why is the sky blue? Answer briefly.",
    "Give me three tips for writing clear commit messages.",
    "What does HTTP status code 404 mean?",
    "Explain recursion to a beginner with a short example.",
    "What are the main causes of the seasons on Earth?",
    "How do I reverse a string in JavaScript?",
    "Summarise what a REST API is in two sentences.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Explain the difference between TCP and UDP.",
    "Suggest a name for a small bakery and explain the choice.",
]


@dataclass(slots=True, frozen=True)
class BenchRequest:
    workload: str  # "edit" or "chat"
    index: int
    messages: tuple[tuple[str, str], ...]  # (role, content)
    label: str

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def edit_request(index: int) -> BenchRequest:
    name, instruction = EDITS[index % len(EDITS)]
    lang, text = FILES[name]
    user = (
        f"Edit `{name}`: {instruction}.\n\n```{lang}\n{text}```\n\n"
        f"Return the whole updated `{name}` in a ```{lang} block."
    )
    return BenchRequest(
        "edit", index, (("system", EDIT_SYSTEM), ("user", user)), f"{name}: {instruction[:30]}"
    )


def chat_request(index: int) -> BenchRequest:
    question = CHAT[index % len(CHAT)]
    return BenchRequest("chat", index, (("user", question),), question[:40])


WORKLOADS = {"edit": edit_request, "chat": chat_request}


def requests(workload: str, count: int) -> list[BenchRequest]:
    """The first `count` requests of a workload (past the end, the list repeats)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; use one of {sorted(WORKLOADS)}")
    return [WORKLOADS[workload](i) for i in range(count)]
