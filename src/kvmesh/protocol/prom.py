"""Prometheus text pages, read by one hand parser (parse_samples) that the router's scrapes and
the benchmarks share: the load gauges a router needs from a vLLM-compatible /metrics page, and
any sample a benchmark counts. prometheus_client's own parser reads the same samples but is
about 30x slower, too slow for a scrape of every endpoint every 100 ms."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

# current names first, then the names older vLLM versions used
WAITING = ("vllm:num_requests_waiting",)
RUNNING = ("vllm:num_requests_running",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class EngineLoad(NamedTuple):
    waiting: float
    running: float
    kv_usage: float  # 0..1, the mean over data-parallel engines on one page


def parse_engine_load(text: str) -> EngineLoad:
    """Sum queue gauges and average KV usage over every `engine` series on the page. Reads only
    the lines that start with a wanted name (found with str.find), the samples parse_samples
    would give for that name, in page order."""
    usage = _first_values(text, KV_USAGE)
    return EngineLoad(
        sum(_first_values(text, WAITING)),
        sum(_first_values(text, RUNNING)),
        sum(usage) / len(usage) if usage else 0.0,
    )


def _first_values(text: str, names: tuple[str, ...]) -> list[float]:
    """The sample values of the first of `names` the page has samples of."""
    for name in names:
        values = [s.value for s in _samples_named(text, name)]
        if values:
            return values
    return []


def _samples_named(text: str, name: str) -> Iterator[Sample]:
    """The samples of metric `name` on the page, in page order, without reading other lines: a
    sample line starts with its name (after blanks), unlike a # HELP or # TYPE line."""
    start = text.find(name)
    while start >= 0:
        line_start = text.rfind("\n", 0, start) + 1
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        if text[line_start:start].isspace() or line_start == start:
            for sample in parse_samples(text[line_start:end]):
                if sample.name == name:
                    yield sample
        start = text.find(name, end)


class Sample(NamedTuple):
    """One sample line of a Prometheus text page."""

    name: str
    labels: dict[str, str]  # in page order
    value: float

    def series(self) -> str:
        """`name{label="value",...}` as prometheus_client writes the series (the name alone
        without labels): a key that names the series."""
        if not self.labels:
            return self.name
        pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in self.labels.items())
        return f"{self.name}{{{pairs}}}"


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,?)')
_ESCAPED = re.compile(r"\\(.)")
_UNESCAPE = {"n": "\n", '"': '"', "\\": "\\"}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPED.sub(lambda m: _UNESCAPE.get(m.group(1), "\\" + m.group(1)), value)


def parse_samples(text: str, keep: Callable[[str], bool] | None = None) -> Iterator[Sample]:
    """The samples of a Prometheus text page (format 0.0.4: what vLLM, kvmesh and
    prometheus_client serve), in page order. Comments, blank lines and lines that do not parse
    are skipped; a sample's timestamp is dropped. A line whose metric name `keep` refuses is
    skipped before its labels are read, which keeps a scrape of a few gauges cheap."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        m = _NAME.match(line)
        if m is None or (keep is not None and not keep(m.group())):
            continue
        pos, labels = m.end(), {}
        if line.startswith("{", pos):
            pos += 1
            while (lab := _LABEL.match(line, pos)) is not None:
                labels[lab.group(1)] = _unescape(lab.group(2))
                pos = lab.end()
                if not lab.group(3):
                    break
            rest = line[pos:].lstrip()
            if not rest.startswith("}"):
                continue
            rest = rest[1:]
        else:
            rest = line[pos:]
            if not rest[:1].isspace():  # the name must end at a space or a brace
                continue
        fields = rest.split()
        if not 1 <= len(fields) <= 2:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        yield Sample(m.group(), labels, value)


CACHE_CONFIG_INFO = "vllm:cache_config_info"  # an info gauge: CacheConfig's fields as labels


def parse_block_size(text: str) -> int | None:
    """The KV block size a /metrics page declares: the `block_size` label of its first
    `vllm:cache_config_info` sample (vLLM and kvmesh engines publish it); None when the page
    has none or its label is not a positive integer."""
    start = text.find(CACHE_CONFIG_INFO)
    while start >= 0:
        line_start = text.rfind("\n", 0, start) + 1
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        for sample in parse_samples(text[line_start:end]):  # a # HELP or # TYPE line: none
            if sample.name == CACHE_CONFIG_INFO and sample.value:
                size = sample.labels.get("block_size", "")
                if size.isdigit() and int(size) > 0:
                    return int(size)
        start = text.find(CACHE_CONFIG_INFO, end)
    return None
