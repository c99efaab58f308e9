"""Speculative decoding in the whole engine on SmolLM2: the output is the output without it
(greedy: token for token, through chunked prefill, preemption, stop strings and max_tokens),
drafts are counted as vLLM counts them, and only verified tokens reach the prefix cache."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest

from kvmesh.engine.builder import assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.engine.torch_runner import TorchRunner

CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
EDIT = f"Rename width to w in this file and return the whole file.\n\n{CODE}\n"
PROMPTS = [EDIT, "The capital of France is", f"Copy this text exactly:\n{CODE}\nCopy:\n"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread: conftest


def run(smollm2, prompts, spec=None, sampling=None, **cfg):
    if spec is not None:
        cfg["speculative_config"] = json.dumps(spec)
    config = EngineConfig(**{"num_gpu_blocks": 256, **cfg})
    bundle = assemble(config, TorchRunner(config, smollm2), smollm2.tokenizer, "m", "p", ())
    core = bundle.engine.core
    reqs = []
    for i, p in enumerate(prompts):
        ids = smollm2.tokenizer.encode(p) if isinstance(p, str) else p
        params = SamplingParams(**(sampling or {"max_tokens": 40, "temperature": 0}))
        reqs.append(Request(str(i), ids, params, eos_token_ids=(2,)))
        core.add_request(reqs[-1])
    texts = {r.request_id: "" for r in reqs}
    for _ in range(3000):
        if not core.has_work():
            break
        for out in core.step():
            texts[out.request_id] += out.text
    bundle.publisher.close()
    return reqs, texts, bundle


def counters(bundle) -> dict[str, float]:
    page = generate_latest(bundle.metrics.registry).decode()
    values = {}
    for line in page.splitlines():
        if line.startswith("vllm:spec_decode") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _assert_ngram_greedy_equals_plain(smollm2, prompts, max_tokens: int, **cfg) -> None:
    """Greedy output with n-gram drafts is the output without them, token for token; drafts are
    accepted and counted per position as vLLM counts them; some steps emit several tokens."""
    sampling = {"max_tokens": max_tokens, "temperature": 0}
    plain, plain_text, _ = run(smollm2, prompts, sampling=sampling, **cfg)
    spec, spec_text, bundle = run(smollm2, prompts, NGRAM, sampling=sampling, **cfg)
    for a, b in zip(plain, spec, strict=True):
        assert b.output_token_ids == a.output_token_ids
        assert b.status == a.status
    assert spec_text == plain_text
    c = counters(bundle)
    drafts = c['vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}']
    accepted = c['vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"}']
    assert drafts > 0 and accepted > 0  # the edit prompts are copied: drafts do get accepted
    per_pos = [
        c[
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{p}"}}'
        ]
        for p in range(4)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    steps_plain = sum(r.num_output_tokens for r in plain)
    assert bundle.engine.core.num_steps < steps_plain  # several tokens per step
    if cfg.get("num_gpu_blocks", 256) < 32:
        assert bundle.engine.core.scheduler.num_preemptions > 0


def test_ngram_greedy_equals_plain_quick(smollm2):
    """The smoke of the runs below: two copy-heavy prompts, fewer tokens, chunked prefill with
    drafts trimmed to the budget, and preemption."""
    cfg = {"num_gpu_blocks": 20, "block_size": 4, "max_num_batched_tokens": 16}
    _assert_ngram_greedy_equals_plain(smollm2, PROMPTS[::2], 20, **cfg)


@pytest.mark.slow  # ~40 s together with one torch thread; the quick smoke above runs by default
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefill; drafts trimmed to the budget
        {"num_gpu_blocks": 24, "block_size": 4, "max_num_batched_tokens": 64},  # preemption
    ],
    ids=["batched", "chunked", "preempting"],
)
def test_ngram_greedy_equals_plain(smollm2, cfg):
    _assert_ngram_greedy_equals_plain(smollm2, PROMPTS, 40, **cfg)


@pytest.mark.parametrize("stop", [{"max_tokens": 13}, {"max_tokens": 60, "stop": ["height"]}])
def test_stops_inside_accepted_drafts(smollm2, stop):
    sampling = {"temperature": 0, **stop}
    plain, plain_text, _ = run(smollm2, PROMPTS[2:], sampling=sampling)
    spec, spec_text, _ = run(smollm2, PROMPTS[2:], NGRAM, sampling=sampling)
    assert spec[0].output_token_ids == plain[0].output_token_ids
    assert spec[0].stop_reason == plain[0].stop_reason
    assert spec_text == plain_text


def test_only_verified_tokens_are_cached(smollm2):
    reqs, _, bundle = run(smollm2, PROMPTS, NGRAM, block_size=4)
    kv = bundle.engine.core.kv
    verified = set()
    for r in reqs:  # every full block of each final token list, and nothing else
        kv.update_block_hashes(r)
        verified.update(r.block_hashes)
    cached = set(kv.pool.cached)
    assert cached and cached <= verified


def test_sampled_with_seed_runs_and_counts(smollm2):
    sampling = {"max_tokens": 30, "temperature": 0.7, "seed": 3, "logprobs": 2}
    reqs, texts, bundle = run(smollm2, PROMPTS, NGRAM, sampling=sampling)
    for r in reqs:
        assert r.num_output_tokens == 30 or r.status.finish_reason == "stop"
        assert len(r.output_logprobs) == r.num_output_tokens
        assert all(len(e) == 3 for e in r.output_logprobs)
    again, texts2, _ = run(smollm2, PROMPTS, NGRAM, sampling=sampling)
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in reqs]


def test_disable_by_batch_size(smollm2):
    spec = {**NGRAM, "disable_by_batch_size": 2}
    sampling = {"max_tokens": 30, "temperature": 0, "ignore_eos": True}
    alone, _, bundle = run(smollm2, PROMPTS[::2], spec, sampling, max_num_seqs=1)
    drafts = 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}'
    assert counters(bundle)[drafts] > 0  # one running request: below the limit
    both, _, bundle = run(smollm2, PROMPTS[::2], spec, sampling)
    assert counters(bundle)[drafts] == 0  # two running to the end together: never drafts
    assert [r.output_token_ids for r in both] == [r.output_token_ids for r in alone]


def test_bad_speculative_config_is_refused():
    with pytest.raises(ValueError, match="unknown method"):
        EngineConfig(speculative_config='{"method": "medusa2", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(speculative_config="{")


def test_served_stream_equals_plain_and_metrics(smollm2):
    from tests.conftest import engine_server
    from tests.helpers import http

    body = {
        "messages": [{"role": "user", "content": EDIT}],
        "max_tokens": 48,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    with engine_server(smollm2) as (url, _):
        _, _, plain = http(f"{url}/v1/chat/completions", body)
    with engine_server(smollm2, speculative_config=json.dumps(NGRAM)) as (url, _):
        _, _, spec = http(f"{url}/v1/chat/completions", body)
        status, _, raw = http(f"{url}/v1/chat/completions", {**body, "stream": True})
        _, _, page = http(f"{url}/metrics")
    plain, spec = json.loads(plain), json.loads(spec)
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    assert spec["usage"] == plain["usage"]
    lp_plain = plain["choices"][0]["logprobs"]["content"]
    lp_spec = spec["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in lp_spec] == [e["token"] for e in lp_plain]
    want = [e["logprob"] for e in lp_plain]  # another batch shape: float noise only
    assert [e["logprob"] for e in lp_spec] == pytest.approx(want, abs=1e-4)
    chunks = [
        json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")
    ]
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert status == 200 and streamed == plain["choices"][0]["message"]["content"]
    text = page.decode()
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in text
    assert "vllm:spec_decode_num_drafts_total{" in text


@pytest.mark.slow  # P/D and tiers with speculation: ~20 s each
def test_pd_decode_engine_speculates(smollm2):
    from tests.conftest import engine_server
    from tests.test_pd_engine import PD, PROMPT, complete, prefill

    spec = json.dumps(NGRAM)
    with (
        engine_server(smollm2, kv_transfer_config=PD) as (p_url, _),
        engine_server(smollm2, kv_transfer_config=PD, speculative_config=spec) as (d_url, d),
    ):
        reference = complete(p_url, PROMPT, max_tokens=40, cache_salt="aggregated")
        params = prefill(p_url, PROMPT)
        out = complete(d_url, PROMPT, max_tokens=40, kv_transfer_params=params)
        assert out["choices"][0]["text"] == reference["choices"][0]["text"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # imported
        accepted = [v for k, v in counters(d).items() if "num_accepted_tokens_total" in k]
        assert accepted and accepted[0] > 0


@pytest.mark.slow  # P/D and tiers with speculation: ~20 s each
def test_prefix_from_host_tier_with_speculation(smollm2):
    from tests.conftest import engine_server
    from tests.test_tiers_engine import TINY, evict_then_reuse

    with engine_server(
        smollm2, kv_offloading_size=0.05, speculative_config=json.dumps(NGRAM), **TINY
    ) as (url, bundle):
        reference, text, cached = evict_then_reuse(url, bundle)
        assert text == reference and cached >= 5 * 16
