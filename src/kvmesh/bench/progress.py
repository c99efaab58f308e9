"""What every `kvmesh bench` shares while it runs: progress lines on stderr that a person (or a
log file) can follow, and the rows finished so far saved as they arrive, so a run stopped by
Ctrl-C or SIGTERM leaves its rows and a marker that it was interrupted.

`BenchRun(bench, out_dir)` saves `<out_dir>/<bench>.rows.json`, rewritten atomically (a temp file
beside it, then os.replace) after every `add(row)`: a reader always sees a whole JSON document,
never a half-written one. Its `status` is "running", then "complete", "interrupted" or "failed".
The bench's own final output (results.json, a plot, a table) is written as before once it ends.

`LineProgress` takes the calls benches make of rich.progress.Progress (add_task, update, advance)
and prints lines instead of redrawing a bar, so the progress shows in a pipe or a log as well as
on a terminal: a task's start, at most one line per task every `every_s` seconds, and its end;
while the newest task says nothing (an engine starting), a line every `heartbeat_s` says so."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvmesh.protocol.wording import plural

EXIT_INTERRUPTED = 130  # the shell's code for a run ended by SIGINT
EXIT_TERMINATED = 143  # ... and by SIGTERM
QUIET_SAVE_S = 2.0  # quiet rows (single requests) are saved at most this often


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so it unwinds as Ctrl-C does (children stop,
    files close) and the run saves what it has."""


def _clock_text(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _count(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    started: float
    printed: float
    finished: bool = False


class LineProgress:
    """rich.progress.Progress's add_task / update / advance, printed as lines on `stream`:
    `[bench engine 1:05] kvmesh: batch 8  12/64 (19%)`."""

    def __init__(
        self,
        name: str,
        *,
        stream: TextIO | None = None,
        every_s: float = 10.0,
        heartbeat_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.every_s, self.heartbeat_s, self.clock = name, every_s, heartbeat_s, clock
        self.stream = stream or sys.stderr  # this one, even where stderr is redirected later
        self.t0 = clock()
        self.tasks: dict[int, _Task] = {}
        self._lock = threading.Lock()  # advance may come from a worker thread
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:  # rich's Live start: nothing to draw here
        return None

    def stop(self) -> None:
        """Ends the heartbeat (a daemon thread: it never holds the process up either way)."""
        self._stop.set()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 3):
            with self._lock:
                t = self.tasks[len(self.tasks) - 1]
                now = self.clock()
                if t.finished or now - t.printed < self.heartbeat_s:
                    continue
                t.printed = now
                text = f"{t.description}  still running ({_clock_text(now - t.started)})"
            self.note(text)

    def note(self, text: str) -> None:
        """One line: a phase begins, a row is saved, something went wrong."""
        elapsed = _clock_text(self.clock() - self.t0)
        print(f"[bench {self.name} {elapsed}] {text}", file=self.stream, flush=True)

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        with self._lock:
            now = self.clock()
            task_id = len(self.tasks)
            self.tasks[task_id] = _Task(description, total, 0, now, now)
            if self._beat is None and self.heartbeat_s > 0 and not self._stop.is_set():
                self._beat = threading.Thread(target=self._heartbeat, daemon=True)
                self._beat.start()
        self.note(f"{description} ..." + (f" 0/{_count(total)}" if total else ""))
        return task_id

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(
        self,
        task_id: int,
        *,
        total: float | None = None,
        completed: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        **_: Any,
    ) -> None:
        with self._lock:
            t = self.tasks[task_id]
            if total is not None:
                t.total = total
            if completed is not None:
                t.completed = completed
            if advance:
                t.completed += advance
            if description is not None:
                t.description = description
            now = self.clock()
            done = t.total is not None and t.completed >= t.total
            if t.finished or not done and now - t.printed < self.every_s:
                return
            t.printed, t.finished = now, done
            text = self._line(t, now)
        self.note(text)

    def _line(self, t: _Task, now: float) -> str:
        if t.total is None:
            return f"{t.description}  {_count(t.completed)} so far"
        count = f"{_count(t.completed)}/{_count(t.total)}"
        if t.completed >= t.total:
            return f"{t.description}  done {count} in {now - t.started:.1f} s"
        return f"{t.description}  {count} ({100 * t.completed / max(t.total, 1e-9):.0f}%)"


def _now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_json_atomic(path: Path, doc: Any) -> None:
    """`doc` as JSON at `path`, replacing it in one step: a reader (or a run killed mid-write)
    sees the previous version or this one, never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BenchRun:
    """One bench run: its progress (`progress`, `note`) and its rows, saved after each `add`.

    Use as `return BenchRun("engine", out).call(body, args)`: `body(args, run)` runs with
    SIGTERM turned into `Terminated`; Ctrl-C or SIGTERM saves the rows with status
    "interrupted" and `call` returns 130 (143 for SIGTERM) instead of a traceback."""

    def __init__(
        self,
        bench: str,
        out_dir: Path | str,
        *,
        total: int | None = None,
        config: dict | None = None,
        every_s: float = 10.0,
        stream: TextIO | None = None,
    ) -> None:
        self.bench = bench
        self.path = Path(out_dir) / f"{bench.replace(' ', '-')}.rows.json"
        self.total, self.config = total, dict(config or {})
        self.rows: list[dict] = []
        self.status = "running"
        self.error: str | None = None
        self.exit_code: int | None = None
        self.progress = LineProgress(bench, stream=stream, every_s=every_s)
        self.started = _now_text()
        self._t0 = time.monotonic()
        self._old_term: Any = None
        self._saved = 0.0

    @property
    def interrupted(self) -> bool:
        return self.status == "interrupted"

    def note(self, text: str) -> None:
        self.progress.note(text)

    def phase(self, text: str, i: int | None = None, n: int | None = None) -> None:
        """A line that says which phase starts, `i` of `n` when counted."""
        self.note(f"phase {i}/{n}: {text}" if i is not None and n is not None else text)

    def add(self, row: dict, label: str | None = None, *, quiet: bool = False) -> None:
        """A finished row: kept, saved at once, and announced on the progress stream. A quiet
        row (one request of thousands) is saved with the next save at most QUIET_SAVE_S later,
        or when the run ends, and is not announced."""
        self.rows.append(row)
        now = time.monotonic()
        if quiet and now - self._saved < QUIET_SAVE_S:
            return
        self.save()
        if quiet:
            return
        of = f"/{self.total}" if self.total else ""
        name = f": {label}" if label else ""
        self.note(f"row {len(self.rows)}{of} saved{name} -> {self.path}")

    def document(self) -> dict:
        doc = {
            "bench": self.bench,
            "status": self.status,
            "interrupted": self.interrupted,
            "started": self.started,
            "updated": _now_text(),
            "elapsed_s": round(time.monotonic() - self._t0, 2),
            "argv": sys.argv[1:],
            "rows_done": len(self.rows),
            "rows_total": self.total,
            "config": self.config,
            "rows": self.rows,
        }
        if self.error:
            doc["error"] = self.error
        if self.exit_code is not None:
            doc["exit_code"] = self.exit_code
        return doc

    def save(self) -> None:
        write_json_atomic(self.path, self.document())
        self._saved = time.monotonic()

    def finish(self, status: str = "complete") -> None:
        self.status = status
        self.save()

    def __enter__(self) -> BenchRun:
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        self.save()
        of = f" ({plural(self.total, 'row')})" if self.total else ""
        self.note(f"started{of}; rows are saved as they finish to {self.path}")
        return self

    def _on_term(self, signum: int, frame: object) -> None:
        raise Terminated()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        self.progress.stop()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        if exc is None:
            if self.status == "running":
                self.finish("complete")
            return False
        if isinstance(exc, KeyboardInterrupt):
            term = isinstance(exc, Terminated)
            self.exit_code = EXIT_TERMINATED if term else EXIT_INTERRUPTED
            self.error = "SIGTERM" if term else "SIGINT (Ctrl-C)"
            self.finish("interrupted")
            saved = plural(len(self.rows), "row")
            self.note(f"interrupted by {self.error}: {saved} saved in {self.path}")
            return True
        self.error = f"{type(exc).__name__}: {exc}"[:500]
        self.finish("failed")
        self.note(f"failed ({self.error}): {plural(len(self.rows), 'row')} saved in {self.path}")
        return False

    def call(self, body: Callable[..., int | None], *args: Any) -> int:
        """`body(*args, self)` inside this run; its exit code, or 130 / 143 when stopped."""
        code: int | None = None
        with self:
            code = body(*args, self)
        if self.exit_code is None:  # ran to its end: a non-zero code is the bench's failure
            self.exit_code = code or 0
            self.finish("complete" if self.exit_code == 0 else "failed")
        return self.exit_code
