"""The Mooncake trace format and its one conversion to token prompts, read by `kvmesh bench`
(prompts sent over HTTP) and `kvmesh sim` (prompts in virtual time) alike.

A row is a JSON object per line: `timestamp` (ms), `input_length` and `output_length` (tokens)
and `hash_ids`, one id per 512-token block of the prompt, equal ids meaning equal blocks at equal
positions after equal prefixes (Mooncake's FAST'25 trace release).

The conversion: block id h is the token ids h*512 .. h*512+511 wherever it appears, cut to the
input length in a prompt's last block. So two prompts that share their first k hash ids share
exactly their first k*512 tokens (the next block starts with a different id), and a prompt has
exactly input_length tokens. Tokens past a row's blocks (a row with fewer hash ids than its
length needs) are ids of that row alone, above every block's ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash id
TAIL_BASE = 1 << 40  # first id of the unshared tails; block ids stay below it
TAIL_SPAN = 1 << 20  # ids reserved for one row's tail
MAX_HASH_ID = TAIL_BASE // TRACE_BLOCK - 1

Runs = tuple[tuple[int, int], ...]  # (first token id, count): runs of consecutive token ids


@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int  # 0-based line number in the file: names the row's own tail
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def max_tokens(self) -> int:
        """Tokens to generate: the output length, at least one (an engine always makes one)."""
        return max(1, self.output_length)

    def token_runs(self) -> Runs:
        """The prompt as runs of consecutive token ids, input_length tokens in all."""
        runs: list[tuple[int, int]] = []
        left = self.input_length
        for h in self.hash_ids:
            if left <= 0:
                break
            take = min(TRACE_BLOCK, left)
            runs.append((h * TRACE_BLOCK, take))
            left -= take
        if left > 0:
            runs.append((TAIL_BASE + self.line * TAIL_SPAN, left))
        return tuple(runs)

    def token_ids(self) -> list[int]:
        return [t for first, n in self.token_runs() for t in range(first, first + n)]


def _int(row: dict, key: str, line: int) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"trace line {line + 1}: {key} must be a non-negative integer")
    return value


def parse_row(text: str, line: int = 0) -> TraceRow:
    """One trace line; ValueError naming the line and field when it is not a Mooncake row."""
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"trace line {line + 1}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError(f"trace line {line + 1}: not a JSON object")
    ts = row.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"trace line {line + 1}: timestamp must be a number (ms)")
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= MAX_HASH_ID for h in ids
    ):
        raise ValueError(
            f"trace line {line + 1}: hash_ids must be a list of integers in [0, {MAX_HASH_ID}]"
        )
    n = _int(row, "input_length", line)
    if n - TRACE_BLOCK * len(ids) >= TAIL_SPAN:
        raise ValueError(f"trace line {line + 1}: input_length runs far past its hash_ids")
    return TraceRow(line, float(ts), n, _int(row, "output_length", line), tuple(ids))


def read_trace(path: str | Path, limit: int = 0, start: int = 0) -> list[TraceRow]:
    """The rows of a trace file, skipping its first `start` lines, at most `limit` rows
    (0: all); blank lines are skipped."""
    rows: list[TraceRow] = []
    with open(path) as f:
        for line, text in enumerate(f):
            if line < start or not text.strip():
                continue
            if limit and len(rows) >= limit:
                break
            rows.append(parse_row(text, line))
    return rows


def arrival_offsets(
    rows: list[TraceRow], time_scale: float = 1.0, rate: float = 0.0
) -> list[float]:
    """Seconds from the first row's timestamp to each row's, times `time_scale`; with `rate` > 0,
    rescaled instead so that the rows arrive at a mean of `rate` per second."""
    if not rows:
        return []
    t0 = rows[0].timestamp_ms
    span = (rows[-1].timestamp_ms - t0) / 1000
    scale = (len(rows) - 1) / span / rate if rate > 0 and span > 0 else time_scale
    return [(r.timestamp_ms - t0) / 1000 * scale for r in rows]
