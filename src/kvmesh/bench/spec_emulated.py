"""`kvmesh bench spec --emulated`: MTP speculative decoding on the emulated GLM-5.2-class fleet.

The layout is the decode side of llm-d's GLM-5.2 guide: one DP16/EP16 instance (wide EP over two
8-GPU H200 nodes, DeepEP low-latency all-to-all), priced by the same wide-EP roofline that
`kvmesh serve --emulate-model glm-5.2-moe --emulate-gpu h200 --data-parallel-size 16
--enable-expert-parallel` steps its ranks with. At each concurrency C the C users decode at
CONTEXT tokens, spread evenly over the ranks (vLLM's internal load balancer), and output tok/s
per user is tokens per step / step time:

- without MTP: one token per step;
- with MTP 3: the step verifies 4 rows per user and pays the drafter (3 one-layer passes), and
  yields 1 + a1 + a1 a2 + a1 a2 a3 tokens on average at the emulation's per-position acceptance
  (kvmesh.engine.emulation.spec.DEFAULT_ACCEPTANCE, fitted to the guide's ratio).

One concurrency is cross-checked against the real engine cores: a DPGroup (one EngineCore per
rank, in virtual time) with and without `--speculative-config {"method": "mtp",
"num_speculative_tokens": 3}`, measured over its decode steps.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

from kvmesh.bench.progress import BenchRun
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.dp_group import DPGroup
from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS
from kvmesh.engine.emulation.spec import DEFAULT_ACCEPTANCE, expected_tokens_per_step
from kvmesh.engine.emulation.wide_ep import WideEPRoofline
from kvmesh.engine.emulation.work import SequenceWork
from kvmesh.engine.sequence import Request, SamplingParams

GPU, MODEL, DP_SIZE = "h200", "glm-5.2-moe", 16
NUM_SPEC_TOKENS = 3  # the guide's MTP_NUM_TOKENS default
CONTEXT = 32768  # tokens in the cache of a decoding request (a mid-session agentic turn)
LEVELS = (1, 8, 32, 128, 512)
QUICK_LEVELS = (1, 32)
GUIDE = {"with_mtp": 60.0, "without_mtp": 26.0}  # llm-d GLM-5.2 guide, tok/s per user
GUIDE_NOTE = (
    "llm-d GLM-5.2 guide (H200, P/D, DEP16 decode, agentic traces): ~60 vs ~26 output tok/s "
    "per user with and without MTP 3; no acceptance rate is given, so the emulation's "
    "per-position rates are fitted to that ratio"
)
MTP_CONFIG = {"method": "mtp", "num_speculative_tokens": NUM_SPEC_TOKENS}


def roofline() -> WideEPRoofline:
    return WideEPRoofline(ACCELERATORS[GPU], MODELS[MODEL], DP_SIZE)


def steady_rate(ep: WideEPRoofline, users: int, k: int, context: int = CONTEXT) -> dict:
    """Per-user decode rate of `users` sequences at `context`, k drafts each (0: no MTP)."""
    base, extra = divmod(users, ep.dp_size)
    row = SequenceWork(1 + k, context, False, k, k)
    works = [[row] * (base + (r < extra)) for r in range(ep.dp_size)]
    cost = ep.step_cost(works)
    tokens = expected_tokens_per_step(DEFAULT_ACCEPTANCE, k) if k else 1.0
    return {
        "tok_s_per_user": round(tokens / cost.time, 2),
        "tokens_per_step": round(tokens, 3),
        "step_ms": round(cost.time * 1e3, 2),
        "itl_ms": round(cost.time / tokens * 1e3, 2),
        "tok_s_per_gpu": round(users * tokens / cost.time / ep.num_gpus, 1),
    }


def measure_engine(users: int, spec: dict | None, steps: int, context: int = CONTEXT) -> dict:
    """The real rank cores in lockstep (virtual time): per-user rate over `steps` decode steps
    once every request decodes."""
    from kvmesh.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)[0]
    config = EngineConfig(block_size=64, max_num_seqs=256, max_num_batched_tokens=8192)
    if spec is not None:
        config = replace(config, speculative_config=json.dumps(spec))
    group = DPGroup(roofline(), config, tokenizer)
    params = SamplingParams(max_tokens=steps * (NUM_SPEC_TOKENS + 1) + 64, ignore_eos=True)
    for u in range(users):  # unique prompts: 4 marker tokens, then a shared body
        prompt = [20000 + 4 * u + i for i in range(4)] + [300 + j for j in range(context - 4)]
        group.add_request(Request(f"u{u}", prompt, params))
    produced: dict[str, int] = {}
    while len(produced) < users or min(produced.values()) < 2:  # prefill, then one decode
        for _, out in group.step().outputs:
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.token_ids)
    start_time, start_tokens = group.now, sum(produced.values())
    for _ in range(steps):
        for _, out in group.step().outputs:
            produced[out.request_id] += len(out.token_ids)
    seconds = group.now - start_time
    tokens = sum(produced.values()) - start_tokens
    return {
        "tok_s_per_user": round(tokens / users / seconds, 2),
        "tokens_per_step": round(tokens / users / steps, 3),
        "step_ms": round(seconds / steps * 1e3, 2),
        "steps": steps,
    }


def run_emulated(out_dir: pathlib.Path, quick: bool = False, bench: BenchRun | None = None) -> dict:
    """Tok/s per user with and without MTP 3 at rising concurrency; writes spec_emulated.json
    and spec_emulated.png into out_dir and returns what the JSON holds. `bench` saves each
    concurrency's row as it is measured."""
    ep = roofline()
    levels = QUICK_LEVELS if quick else LEVELS
    if bench is not None:
        bench.total = len(levels)
    rows = []
    for users in levels:
        off, on = steady_rate(ep, users, 0), steady_rate(ep, users, NUM_SPEC_TOKENS)
        rows.append(
            {
                "concurrency": users,
                "without_mtp": off,
                "with_mtp": on,
                "speedup": round(on["tok_s_per_user"] / off["tok_s_per_user"], 2),
            }
        )
        if bench is not None:
            bench.add(rows[-1], f"C={users}")
    check_users, check_steps = (16, 30) if quick else (32, 200)
    if bench is not None:
        bench.note(f"cross-check: emulated engines at C={check_users}, {check_steps} steps")
    check = {
        "concurrency": check_users,
        "context": CONTEXT,
        "engine": {
            "without_mtp": measure_engine(check_users, None, check_steps),
            "with_mtp": measure_engine(check_users, MTP_CONFIG, check_steps),
        },
        "model": {
            "without_mtp": steady_rate(ep, check_users, 0),
            "with_mtp": steady_rate(ep, check_users, NUM_SPEC_TOKENS),
        },
    }
    result = {
        "layout": f"DP{DP_SIZE}/EP{DP_SIZE} on {ACCELERATORS[GPU].name}, {MODELS[MODEL].name}",
        "context": CONTEXT,
        "speculative_config": MTP_CONFIG,
        "acceptance_per_position": list(DEFAULT_ACCEPTANCE),
        "expected_tokens_per_step": round(
            expected_tokens_per_step(DEFAULT_ACCEPTANCE, NUM_SPEC_TOKENS), 3
        ),
        "rows": rows,
        "guide": {**GUIDE, "ratio": round(GUIDE["with_mtp"] / GUIDE["without_mtp"], 2)},
        "guide_note": GUIDE_NOTE,
        "cross_check": check,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec_emulated.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "spec_emulated.png")
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, color in (("with_mtp", "MTP 3", "C0"), ("without_mtp", "no MTP", "C1")):
        ax.plot(xs, [r[key]["tok_s_per_user"] for r in rows], "o-", color=color, label=label)
        ax.axhline(result["guide"][key], color=color, ls="--", lw=1, label=f"guide {label}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("output tok/s per user")
    ax.set_title(f"Emulated {result['layout']}, context {result['context']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
