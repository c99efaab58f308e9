"""Closed-loop users against one emulated DP group in virtual time, and what they measured.

C users each keep one request in flight: the next is sent the moment the previous one ends
(no think time), as the wide-EP guide's concurrency runs do. `random` traffic is prompts of
`input_len` unique tokens; `agentic` traffic is sessions whose prompts start with a system prompt
shared by a group of sessions and grow turn after turn by the previous answer and `turn_tokens`
new tokens, restarting when they pass `max_context`. A warm start puts the population mid-stream
from the first step (each user's first request already holds a random share of its output), so
the measured window sees a steady state after a short warm-up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvmesh.engine.emulation.dp_group import DPGroup
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.protocol.stats import percentile

FILLER = list(range(300, 300 + 65536))  # shared prompt body: one int object per position
MARK = 20000  # markers (first tokens) are >= MARK so that no two prompts share a first block


@dataclass(slots=True)
class Traffic:
    input_len: int = 2048
    output_len: int = 2048
    workload: str = "random"  # or "agentic"
    shared_prefix_len: int = 2048  # agentic: system prompt shared by a group of sessions
    group_size: int = 16  # agentic: sessions per shared system prompt
    turn_tokens: int = 512  # agentic: new tokens each later turn adds (tool output, message)
    max_context: int = 32768  # agentic: a session restarts once its prompt would pass this
    dp_rank_affinity: bool = False  # agentic: later turns name their session's first rank

    def __post_init__(self) -> None:
        if self.workload not in ("random", "agentic"):
            raise ValueError("--workload must be random or agentic")
        if min(self.input_len, self.output_len) < 1:
            raise ValueError("--input-len and --output-len must be at least 1")
        longest = max(self.input_len + self.output_len, self.shared_prefix_len, self.turn_tokens)
        if longest > len(FILLER):
            raise ValueError(f"prompts and outputs are limited to {len(FILLER)} tokens here")
        if self.turn_tokens < 4:
            raise ValueError("--turn-tokens must be at least 4")


@dataclass(slots=True)
class _User:
    uid: int
    session: int = 0
    turn: int = 0
    prompt: list[int] = field(default_factory=list)
    rank: int | None = None  # the rank its session started on (affinity)


@dataclass(slots=True)
class Window:
    """What the measured steps saw."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    comm: float = 0.0
    imbalance: float = 0.0
    running: float = 0.0  # running requests summed over steps (all ranks)
    waiting: float = 0.0  # waiting requests summed over steps (all ranks)
    censored: int = 0  # arrivals of the window still without a first token at its end
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def summary(self, num_gpus: int, dp_size: int) -> dict:
        s = max(self.seconds, 1e-12)
        return {
            "output_tok_s": round(self.tokens / s, 1),
            "output_tok_s_per_gpu": round(self.tokens / s / num_gpus, 1),
            "itl_ms_p50": round(percentile(self.itl, 50) * 1e3, 2),
            "itl_ms_p90": round(percentile(self.itl, 90) * 1e3, 2),
            # arrivals still waiting at the end count with their wait so far (a lower bound)
            "ttft_ms_p50": round(percentile(self.ttft, 50) * 1e3, 1),
            "ttft_count": len(self.ttft),
            "ttft_censored": self.censored,
            "step_ms_mean": round(self.seconds / max(1, self.steps) * 1e3, 2),
            "comm_share": round(self.comm / s, 3),
            "imbalance": round(self.imbalance / max(1, self.steps), 3),
            "running_per_rank": round(self.running / max(1, self.steps) / dp_size, 1),
            "waiting_per_rank": round(self.waiting / max(1, self.steps) / dp_size, 1),
            "finished": self.finished,
            "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4)
            if self.prompt_tokens
            else 0.0,
            "window_s": round(self.seconds, 3),
            "window_steps": self.steps,
        }


class ClosedLoop:
    def __init__(self, group: DPGroup, traffic: Traffic, users: int, seed: int = 0) -> None:
        self.group, self.traffic = group, traffic
        self.rng = random.Random(seed)
        self.users = [_User(u) for u in range(users)]
        self.next_rid = 0
        self.arrival: dict[str, float] = {}
        self.owner: dict[str, _User] = {}
        self.outputs: dict[str, list[int]] = {}
        self.last_token: dict[str, float] = {}
        self.submitted = self.completed = 0

    def _marker(self, *ids: int) -> list[int]:
        return [MARK + i for i in ids]

    def _first_prompt(self, user: _User, length: int) -> list[int]:
        t = self.traffic
        unique = self._marker(user.uid, user.session) + FILLER[: max(0, length - 2)]
        if t.workload == "random":
            return unique[:length]
        group = user.uid // t.group_size
        system = self._marker(1_000_000 + group) + FILLER[: t.shared_prefix_len - 1]
        return system + unique[:length]

    def _send(self, user: _User, prompt: list[int], max_tokens: int) -> None:
        rid = f"u{user.uid}-{self.next_rid}"
        self.next_rid += 1
        pin = user.rank if (self.traffic.dp_rank_affinity and user.turn > 0) else None
        rank = self.group.add_request(
            Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), pin
        )
        if user.turn == 0:
            user.rank = rank
        user.prompt = prompt
        self.arrival[rid], self.owner[rid], self.outputs[rid] = self.group.now, user, []
        self.submitted += 1

    def start(self, warm: bool = True) -> None:
        """Every user's first request; warm: as if a random share of its output were done."""
        t = self.traffic
        for user in self.users:
            done = int(self.rng.random() * t.output_len) if warm else 0
            self._send(user, self._first_prompt(user, t.input_len + done), t.output_len - done)

    def _next(self, user: _User, rid: str) -> None:
        t = self.traffic
        user.turn += 1
        grown = len(user.prompt) + len(self.outputs[rid]) + t.turn_tokens
        if t.workload == "random" or grown + t.output_len > t.max_context:
            user.session, user.turn = user.session + 1, 0
            self._send(user, self._first_prompt(user, t.input_len), t.output_len)
            return
        turn = self._marker(user.uid, user.session, user.turn) + FILLER[: t.turn_tokens - 3]
        self._send(user, user.prompt + self.outputs[rid] + turn, t.output_len)

    def run(self, warmup_steps: int, steps: int, progress=None) -> Window:
        """`warmup_steps` unmeasured lockstep steps, then `steps` measured ones."""
        w = Window()
        window_start = None
        for i in range(warmup_steps + steps):
            if i == warmup_steps:
                window_start = self.group.now
            step = self.group.step()
            if step.time == 0:
                if not self.group.has_work():
                    break
                raise RuntimeError("the DP group has work but none of it can be scheduled")
            measured = window_start is not None
            now = self.group.now
            if measured:
                w.steps += 1
                w.seconds += step.time
                w.comm += step.cost.comm
                w.imbalance += step.cost.imbalance
                counts = self.group.counts()
                w.running += sum(r for _, r in counts)
                w.waiting += sum(q for q, _ in counts)
            for _, out in step.outputs:
                rid = out.request_id
                if rid not in self.last_token:
                    if measured and self.arrival[rid] >= window_start:
                        w.ttft.append(now - self.arrival[rid])
                        w.prompt_tokens += out.num_prompt_tokens
                        w.cached_tokens += max(0, out.num_cached_tokens)
                elif measured:
                    w.itl.append(now - self.last_token[rid])
                self.last_token[rid] = now
                self.outputs[rid].extend(out.token_ids)
                if measured:
                    w.tokens += len(out.token_ids)
                if out.finished:
                    w.finished += measured
                    self.completed += 1
                    user = self.owner.pop(rid)
                    del self.arrival[rid], self.last_token[rid]
                    self._next(user, rid)
                    del self.outputs[rid]
            if progress is not None:
                progress()
        if window_start is not None:
            late = [
                self.group.now - at
                for rid, at in self.arrival.items()
                if at >= window_start and rid not in self.last_token
            ]
            w.ttft.extend(late)
            w.censored = len(late)
        return w
