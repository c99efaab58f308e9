"""`kvmesh up`'s children (the engine process, the router process) and their supervision, as a
process supervisor or Kubernetes would: a child that exits once the stack is up is started
again after a back-off (restart_initial_delay doubling to restart_max_delay, back to the
initial delay once it had stayed healthy restart_reset_after seconds), each restart one line
on stderr; more than crash_loop_restarts exits of one child within crash_loop_window seconds
is a crash loop and ends `up`. Invariants: a child counts as healthy only while it runs and
holds the port that answered GET /health 200 (never another instance answering there); on
SIGINT, SIGTERM or SIGHUP the children are stopped last started first (the router drains the
answers in progress while the engines still serve them, then the engines go): each gets SIGTERM,
and one still running its grace later (GRACE_S; the router ROUTER_DRAIN_S more) is killed; no
child outlives `up`."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvmesh.commands import up_ports

GRACE_S = 5.0  # after SIGTERM, a child gets this long to finish before it is killed
ROUTER_DRAIN_S = 10.0  # the router's --shutdown-timeout under `up`: its grace is this more
POLL_S = 0.1  # the supervisor's look at its children and at the signals it was sent
WAITING_EVERY_S = 10.0  # while children start, a line at least this often says what is awaited
START_TIMEOUT_S = 900.0  # loading a large model takes minutes; a child stuck longer is stopped


@dataclass(slots=True)
class RestartPolicy:
    """How `kvmesh up` restarts a child that exits after the stack was ready."""

    restart_children: bool = True
    restart_initial_delay: float = 1.0
    restart_max_delay: float = 30.0
    restart_reset_after: float = 60.0
    crash_loop_restarts: int = 5
    crash_loop_window: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.restart_initial_delay <= self.restart_max_delay:
            raise ValueError("restart delays: 0 < --restart-initial-delay <= --restart-max-delay")
        if self.restart_reset_after <= 0 or self.crash_loop_window <= 0:
            raise ValueError("--restart-reset-after and --crash-loop-window must be positive")
        if self.crash_loop_restarts < 0:
            raise ValueError("--crash-loop-restarts must be 0 or positive")

    def next_delay(self, last: float, healthy_for: float) -> float:
        """The back-off before the next restart, after ``last`` (0: none yet) and a run that
        stayed healthy ``healthy_for`` seconds."""
        if last <= 0 or healthy_for >= self.restart_reset_after:
            return self.restart_initial_delay
        return min(self.restart_max_delay, last * 2)


RESTART_HELP = {
    "restart_children": "Restart the engine or router process when it exits after the stack "
    "was ready (the router keeps serving meanwhile, and takes a restarted engine back); off: "
    "one child's exit stops `up`.",
    "restart_initial_delay": "Seconds before the first restart of a child; doubled for each "
    "restart that follows.",
    "restart_max_delay": "Longest wait before a restart, in seconds.",
    "restart_reset_after": "Seconds a restarted child must stay healthy for its next restart "
    "to wait the initial delay again.",
    "crash_loop_restarts": "Restarts of one child within --crash-loop-window after which its "
    "next exit is a crash loop that stops `up`.",
    "crash_loop_window": "Seconds over which a child's exits are counted for a crash loop.",
}


@dataclass(eq=False)
class Child:
    """One child process and what its supervision knows of it."""

    name: str  # "engine" or "router"
    what: str  # how lines name it: "engine", "2 engines", "router"
    cmd: list[str]
    urls: list[str]  # every one must answer GET /health for the child to be healthy
    proc: subprocess.Popen
    started: float  # monotonic
    healthy_since: float | None = None
    restart_at: float | None = None  # it exited and is started again then
    delay: float = 0.0  # the last back-off waited
    drain: float = 0.0  # seconds it may take to drain on SIGTERM, beyond GRACE_S
    restarts: int = 0
    exits: list[float] = field(default_factory=list)  # monotonic, within the crash-loop window


def exit_description(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Stack:
    """The children, their restarts and the signals sent to this process."""

    def __init__(self, env: dict[str, str], policy: RestartPolicy | None = None) -> None:
        self.env = env
        self.policy = policy or RestartPolicy()
        self.children: dict[str, Child] = {}
        self.signalled = False
        self.lines: list[str] = []  # what it said, in order

    def on_signal(self, signum: int, frame) -> None:
        self.signalled = True

    def say(self, line: str, err: bool = False) -> None:
        self.lines.append(line)
        print(line, file=sys.stderr if err else sys.stdout, flush=True)

    def start(
        self, name: str, what: str, cmd: list[str], urls: list[str], drain: float = 0.0
    ) -> Child:
        child = Child(name, what, cmd, urls, self._spawn(cmd), time.monotonic(), drain=drain)
        self.children[name] = child
        return child

    def _spawn(self, cmd: list[str]) -> subprocess.Popen:
        # each child leads its own session, as one started from its own terminal would; and a
        # child outlives no supervisor: it gets SIGTERM when this process dies, even by SIGKILL
        return subprocess.Popen(
            cmd, env=self.env, start_new_session=True, preexec_fn=_die_with_parent()
        )

    def exited(self) -> tuple[str, int] | None:
        """The first child found gone, with its exit code."""
        for name, child in self.children.items():
            code = child.proc.poll()
            if code is not None:
                return name, code
        return None

    def answers(self, child: Child, url: str) -> bool:
        """GET url/health is 200 and the port is the running child's own."""
        port = urlsplit(url).port or 80
        return child.proc.poll() is None and _healthy(url) and _listens(child.proc.pid, port)

    def wait_healthy(self, child: Child) -> bool:
        """Until every URL of child answers: False when a child exits or a signal comes first,
        or START_TIMEOUT_S passes. Every WAITING_EVERY_S a line says how many answer so far;
        one more says when all do."""
        start = time.monotonic()
        deadline, report_at = start + START_TIMEOUT_S, start + WAITING_EVERY_S
        pending, now, urls = list(child.urls), start, child.urls
        while pending:
            if self.signalled or self.exited() or time.monotonic() > deadline:
                return False
            pending = [url for url in pending if not self.answers(child, url)]
            now = time.monotonic()
            if pending and now >= report_at:
                report_at = now + WAITING_EVERY_S
                up = len(urls) - len(pending)
                self.say(
                    f"kvmesh up: waiting for the {child.what}: {up} of {len(urls)} answer "
                    f"/health after {now - start:.0f} s"
                )
            if pending:
                time.sleep(POLL_S)
        child.healthy_since = now
        verb = "answers" if len(urls) == 1 else "answer"
        self.say(f"kvmesh up: the {child.what} {verb} /health after {now - start:.1f} s")
        return True

    def supervise(self) -> int:
        """Until a signal comes (0) or a child exits for good: its exit code (1 for 0)."""
        while not self.signalled:
            for child in self.children.values():
                code = self._look_at(child, time.monotonic())
                if code is not None:
                    return code if code > 0 else 1
            time.sleep(POLL_S)
        return 0

    def _look_at(self, child: Child, now: float) -> int | None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.proc, child.started = self._spawn(child.cmd), now
                child.restart_at, child.healthy_since = None, None
            return None
        code = child.proc.poll()
        if code is not None:
            return self._exited(child, code, now)
        if child.healthy_since is None:
            if all(self.answers(child, url) for url in child.urls):
                child.healthy_since = now
                verb = "answers" if len(child.urls) == 1 else "answer"
                self.say(
                    f"kvmesh up: the {child.what} {verb} /health again after "
                    f"{now - child.started:.1f} s (restart {child.restarts})"
                )
            elif now - child.started > START_TIMEOUT_S:
                self.say(f"kvmesh up: the restarted {child.name} is not healthy; killing it", True)
                child.proc.kill()
        return None

    def _exited(self, child: Child, code: int, now: float) -> int | None:
        """A child that exited on its own: restarted after its back-off, or the exit code
        that ends `up` (no restarts, or a crash loop)."""
        policy, how = self.policy, exit_description(code)
        if not policy.restart_children:
            self.say(f"kvmesh up: the {child.name} {how}; stopping", True)
            return code
        window = policy.crash_loop_window
        child.exits = [t for t in child.exits if now - t < window] + [now]
        if len(child.exits) > policy.crash_loop_restarts:
            self.say(
                f"kvmesh up: the {child.name} {how}, its exit {len(child.exits)} within "
                f"{window:g} s: a crash loop; stopping (its log above says why)",
                True,
            )
            return code
        healthy_for = now - child.healthy_since if child.healthy_since is not None else 0.0
        child.delay = policy.next_delay(child.delay, healthy_for)
        child.restart_at, child.restarts = now + child.delay, child.restarts + 1
        self.say(
            f"kvmesh up: the {child.name} {how}; restart {child.restarts} in {child.delay:g} s",
            True,
        )
        return None

    def restarts(self) -> dict[str, int]:
        return {name: child.restarts for name, child in self.children.items()}

    def stop(self) -> None:
        """Each child still running, last started first: SIGTERM, then SIGKILL if it is still
        there after GRACE_S and its drain time."""
        for child in reversed(list(self.children.values())):
            proc = child.proc
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=GRACE_S + child.drain)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _die_with_parent():
    """preexec_fn that has the kernel send the child SIGTERM when this process dies, even by
    SIGKILL (Linux; None elsewhere). The lookup is done here: a forked child imports nothing."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _listens(pid: int, port: int) -> bool:
    return up_ports.listens_on(pid, port)
