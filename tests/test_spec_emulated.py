"""Speculative decoding in emulated engines: tokens per step follow the configured acceptance,
the drafter is not free, ITL per token falls, the output is the output without speculation, and
n-gram lookup is checked against the emulated output stream."""

from __future__ import annotations

import json

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.emulation.builder import EmulationConfig, build_emulated_engine
from kvmesh.engine.emulation.latency import (
    ACCELERATORS,
    MODELS,
    ConstantLatency,
    RooflineLatency,
    SequenceWork,
)
from kvmesh.engine.emulation.spec import (
    DEFAULT_ACCEPTANCE,
    Acceptance,
    expected_tokens_per_step,
    parse_acceptance,
)
from kvmesh.engine.emulation.wide_ep import WideEPRoofline
from kvmesh.engine.sequence import Request, SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
CONSTANT = {"emulate_ttft_ms": 20.0, "emulate_itl_ms": 5.0}
ROOFLINE = {"emulate_gpu": "h200", "tensor_parallel_size": 8}


def engine(tokenizer, spec=None, emu=None, **cfg):
    if spec is not None:
        cfg["speculative_config"] = json.dumps(spec)
    emu = EmulationConfig(**{"emulate_model": "glm-5.2-moe", **(emu or CONSTANT)})
    return build_emulated_engine(EngineConfig(**cfg), emu, tokenizer)


def run(bundle, tokenizer, prompts, **sampling):
    core = bundle.engine.core
    for i, prompt in enumerate(prompts):
        params = SamplingParams(**{"max_tokens": 64, **sampling})
        core.add_request(Request(str(i), tokenizer.encode(prompt), params))
    done: dict[str, dict] = {str(i): {"text": "", "tokens": []} for i in range(len(prompts))}
    steps = 0
    while core.has_work():
        steps += 1
        for out in core.step():
            d = done[out.request_id]
            d["text"] += out.text
            d["tokens"] += out.token_ids
            if out.finished:
                d["finish_reason"], d["stop_reason"] = out.finish_reason, out.stop_reason
    bundle.publisher.close()
    return done, steps


def counters(bundle) -> dict:
    stats = bundle.engine.core.speculator.metrics.stats
    return {
        "drafts": stats.num_drafts,
        "accepted": stats.num_accepted_tokens,
        "per_pos": stats.accepted_per_pos,
    }


def test_acceptance_draws_follow_the_conditional_rates():
    rates = (0.8, 0.5)
    acc = Acceptance("mtp", rates, seed=("engine", 0))
    counts = [acc.num_accepted([0, 0, 0], lambda j: 0) for _ in range(20000)]
    mean = sum(counts) / len(counts)
    assert mean == pytest.approx(expected_tokens_per_step(rates, 3) - 1, rel=0.03)
    assert sum(c >= 1 for c in counts) / len(counts) == pytest.approx(0.8, abs=0.015)
    assert sum(c >= 3 for c in counts) / len(counts) == pytest.approx(0.8 * 0.25, abs=0.015)
    again = Acceptance("mtp", rates, seed=("engine", 0))  # seeded: the same draws again
    assert [again.num_accepted([0, 0, 0], lambda j: 0) for _ in range(200)] == counts[:200]
    ngram = Acceptance("ngram", rates)  # real matching: the stream decides, not the rates
    assert ngram.num_accepted([5, 6, 9], lambda j: [5, 6, 7][j]) == 2


def test_acceptance_knob_is_validated():
    assert parse_acceptance("0.9, 0.5") == (0.9, 0.5)
    for bad in ("", "1.5", "a,b"):
        with pytest.raises(ValueError, match="spec-acceptance"):
            EmulationConfig(emulate_spec_acceptance=bad)
    assert parse_acceptance(EmulationConfig().emulate_spec_acceptance) == DEFAULT_ACCEPTANCE


def test_mtp_tokens_per_step_match_the_configured_acceptance(tokenizer):
    bundle = engine(tokenizer, MTP, max_num_seqs=16)
    prompts = [f"Request number {i} asks for a long answer." for i in range(16)]
    done, _ = run(bundle, tokenizer, prompts, max_tokens=400)
    c = counters(bundle)
    assert all(len(d["tokens"]) == 400 for d in done.values())
    mean_len = 1 + c["accepted"] / c["drafts"]  # vLLM's mean acceptance length
    assert mean_len > 1.5
    assert mean_len == pytest.approx(expected_tokens_per_step(DEFAULT_ACCEPTANCE, 3), rel=0.04)
    alive = 1.0
    for pos, rate in enumerate(DEFAULT_ACCEPTANCE):  # accepted through position p / drafts
        alive *= rate
        assert c["per_pos"][pos] / c["drafts"] == pytest.approx(alive, abs=0.03)


def test_mtp_output_is_the_output_without_speculation(tokenizer):
    prompts = ["Tell me about engines.", "Where do blocks go?", "A third prompt here."]
    for sampling in (
        {"max_tokens": 37},
        {"max_tokens": 200, "stop": ["router"]},
        {"max_tokens": 200, "stop": ["tiers as"], "include_stop_str_in_output": True},
        {"max_tokens": 9, "logprobs": 1},
    ):
        plain, _ = run(engine(tokenizer), tokenizer, prompts, **sampling)
        spec, _ = run(engine(tokenizer, MTP), tokenizer, prompts, **sampling)
        assert spec == plain, sampling
    reasons = {d["finish_reason"] for d in plain.values()}
    assert reasons == {"length"}
    stopped, _ = run(engine(tokenizer, MTP), tokenizer, prompts, max_tokens=200, stop=["router"])
    assert {d["finish_reason"] for d in stopped.values()} == {"stop"}
    assert {d["stop_reason"] for d in stopped.values()} == {"router"}


def test_itl_per_token_falls_and_the_drafter_is_not_free(tokenizer):
    prompts = [f"Agent {i} continues its session." for i in range(8)]
    per_token = {}
    for name, spec in (("plain", None), ("mtp", MTP)):
        bundle = engine(tokenizer, spec, ROOFLINE)
        done, steps = run(bundle, tokenizer, prompts, max_tokens=300)
        tokens = sum(len(d["tokens"]) for d in done.values())
        per_token[name] = bundle.engine.core.runner.predicted_time_total / tokens * len(prompts)
        if spec is None:
            plain_steps = steps
        else:
            assert steps < plain_steps / 2  # ~2.7 tokens per step
    # 4 rows per user touch ~4x the experts, so the step grows; each token still costs less
    assert per_token["mtp"] < per_token["plain"] / 1.2
    roof = RooflineLatency(ACCELERATORS["h200"], MODELS["glm-5.2-moe"], 8)
    batch = [SequenceWork(1, 4000)] * 8
    verify = [SequenceWork(4, 4000, False, 3, 0)] * 8  # n-gram drafts: lookup is free
    drafted = [SequenceWork(4, 4000, False, 3, 3)] * 8  # MTP: three one-layer passes
    assert roof.step_time(batch) <= roof.step_time(verify) < roof.step_time(drafted)
    layer = (roof.step_time(batch) - roof.step_overhead) / MODELS["glm-5.2-moe"].num_layers
    assert roof.step_time(drafted) - roof.step_time(verify) == pytest.approx(3 * layer, rel=0.05)
    ep = WideEPRoofline(ACCELERATORS["h200"], MODELS["glm-5.2-moe"], 16)
    assert ep.step_time([verify] * 16) < ep.step_time([drafted] * 16)
    # constant mode: verified drafts are decode rows, priced as a decode step
    assert ConstantLatency(0.1, 0.01).step_time(verify) == 0.01


def test_ngram_in_emulation_matches_the_filler_stream(tokenizer):
    prompts = ["Summarise the design.", "Explain the router."]
    plain, _ = run(engine(tokenizer), tokenizer, prompts, max_tokens=240)
    bundle = engine(tokenizer, NGRAM)
    spec, steps = run(bundle, tokenizer, prompts, max_tokens=240)
    assert spec == plain
    c = counters(bundle)
    # the filler repeats every few dozen tokens: once it has, lookup finds it and is right
    assert c["drafts"] > 0 and c["accepted"] / (4 * c["drafts"]) > 0.6
    assert steps < 240 / 2
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        engine(tokenizer, {"method": "mtp"}, {**CONSTANT, "emulate_model": "llama-3.1-8b"})


def test_run_emulated_quick(tmp_path):
    from kvmesh.bench.spec_emulated import run_emulated

    result = run_emulated(tmp_path, quick=True)
    assert (tmp_path / "spec_emulated.json").exists() and (tmp_path / "spec_emulated.png").exists()
    assert result["guide"]["ratio"] == pytest.approx(60 / 26, abs=0.01)
    for row in result["rows"]:
        assert row["with_mtp"]["tok_s_per_user"] > 1.5 * row["without_mtp"]["tok_s_per_user"]
    check = result["cross_check"]
    for key in ("with_mtp", "without_mtp"):
        measured, model = check["engine"][key], check["model"][key]
        assert measured["tok_s_per_user"] == pytest.approx(model["tok_s_per_user"], rel=0.1)
