"""The predicted-latency scorer (router.plugins.latency): its online fit of time to first token,
its scores, the forward bookkeeping that reports first tokens to it, and its place in a
pipeline, in the router's clock and the simulator's."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from kvmesh.bench.workloads import agentic
from kvmesh.engine.tokenizer import load_tokenizer
from kvmesh.router import forward_load
from kvmesh.router.approx_index import ApproximateIndex
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.pipeline import PRESETS, Pipeline
from kvmesh.router.plugins import SchedulingRequest, build_plugin
from kvmesh.router.plugins.latency import (
    FEATURES,
    PredictedLatencyScorer,
    Probe,
    TTFTModel,
    nonnegative_fit,
)
from kvmesh.router.plugins.state import SchedulingState
from kvmesh.sim import replay
from kvmesh.sim.fleet import FleetSim
from kvmesh.sim.requests import workload_requests

# seconds per unit of each feature, in FEATURES order
HOST_BOUND = (0.5, 0.4, 0.01, 0.01, 0.05)  # a request queued ahead costs as much as a long prefill
GPU_BOUND = (0.01, 0.0, 0.02, 0.03, 0.001)  # an uncached token is what costs


def samples(coef, n: int, seed: int = 0, noise: float = 0.0):
    rng = random.Random(seed)
    for _ in range(n):
        x = (1.0, rng.randrange(6), rng.uniform(0, 20), rng.uniform(0, 8), rng.randrange(30))
        y = sum(c * f for c, f in zip(coef, x, strict=True)) + rng.gauss(0, noise)
        yield x, y


def trained(coef, n: int = 64) -> TTFTModel:
    model = TTFTModel()
    for x, y in samples(coef, n):
        model.observed("any", x, y)
    return model


def test_the_fit_recovers_known_coefficients_from_noisy_samples():
    model = TTFTModel(window=512, refit_every=16, min_samples=32)
    for x, y in samples(HOST_BOUND, 512, noise=0.01):
        model.observed("e", x, y)
    assert model.coef is not None and len(model.coef) == len(FEATURES)
    assert model.coef == pytest.approx(HOST_BOUND, abs=0.01)


def test_no_coefficient_is_negative_and_a_prediction_stays_positive():
    """Times that fall as a feature grows (noise, or a feature standing in for another) give
    that feature 0, never a negative price that would make a busier endpoint look faster."""
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.uniform(0, 10, 200)])
    y = 2.0 - 0.15 * x[:, 1] + rng.normal(0, 0.01, 200)
    coef = nonnegative_fit(x, y)
    assert coef[1] == 0.0 and coef[0] == pytest.approx(y.mean())
    model = trained((0.0, 0.0, 0.0, 0.0, 0.0))
    assert model.predict((1.0, 0.0, 0.0, 0.0, 0.0)) > 0


def test_a_feature_that_never_varied_is_priced_at_zero_not_shared_with_the_constant():
    x = np.column_stack([np.ones(50), np.full(50, 3.0), np.arange(50.0)])
    coef = nonnegative_fit(x, 0.2 + 0.01 * x[:, 2])
    assert coef == pytest.approx([0.2, 0.0, 0.01])


def test_nothing_is_predicted_until_min_samples_then_refits_every_refit_every():
    model = TTFTModel(window=64, refit_every=8, min_samples=20)
    stream = samples(GPU_BOUND, 100)
    for x, y in (next(stream) for _ in range(19)):
        model.observed("e", x, y)
    assert model.coef is None and model.predict((1.0, 0, 0, 0, 0)) is None
    model.observed("e", *next(stream))
    assert model.fits == 1
    for x, y in (next(stream) for _ in range(7)):
        model.observed("e", x, y)
    assert model.fits == 1
    model.observed("e", *next(stream))
    assert model.fits == 2


def test_a_busy_router_refits_at_most_every_refit_interval():
    """At thousands of reports a second, refit_every alone would fit hundreds of times a
    second: a refit also waits for refit_interval seconds since the last, on the clock the
    reports come with (the router's monotonic one, the simulator's virtual one)."""
    model = TTFTModel(window=64, refit_every=8, min_samples=20, refit_interval=0.5)
    stream = samples(GPU_BOUND, 200)
    for x, y in (next(stream) for _ in range(20)):
        model.observed("e", x, y, 100.0)
    assert model.fits == 1  # the first fit comes as soon as min_samples are held
    for x, y in (next(stream) for _ in range(40)):
        model.observed("e", x, y, 100.4)
    assert model.fits == 1  # five refit_every's worth, within the interval
    model.observed("e", *next(stream), 100.5)
    assert model.fits == 2 and model.since_fit == 0
    for x, y in (next(stream) for _ in range(7)):
        model.observed("e", x, y, 200.0)
    assert model.fits == 2  # the interval passed, but not refit_every reports
    model.observed("e", *next(stream), 200.0)
    assert model.fits == 3


def test_the_window_forgets_a_regime_that_ended():
    model = TTFTModel(window=128, refit_every=16, min_samples=32)
    for x, y in samples(GPU_BOUND, 300, seed=1):
        model.observed("e", x, y)
    for x, y in samples(HOST_BOUND, 128, seed=2):
        model.observed("e", x, y)
    model.refit()  # (the last refit came up to refit_every reports ago)
    assert model.coef == pytest.approx(HOST_BOUND, abs=1e-6)


def test_a_clock_that_went_back_teaches_nothing():
    model = TTFTModel(min_samples=1)
    model.observed("e", (1.0, 0, 0, 0, 0), -0.5)
    model.observed("e", (1.0, 0, 0, 0, 0), float("nan"))
    assert model.count == 0 and model.coef is None


def endpoint(name: str, pending: int = 0, in_flight: int = 0) -> Endpoint:
    e = Endpoint(f"http://{name}:1", name=name)
    e.pending_prefill_tokens, e.in_flight = pending, in_flight
    return e


def request(held: dict[str, int], blocks: int = 256) -> SchedulingRequest:
    """A prompt of `blocks` 16-token blocks, of which each endpoint holds `held` leading."""
    req = SchedulingRequest("r", None, list(range(blocks * 16)), list(range(blocks)), {}, 16)
    req.state = SchedulingState(blocks * 16, 16, blocks, {}, held)
    return req


def test_every_endpoint_scores_1_until_the_model_has_a_fit():
    scorer = PredictedLatencyScorer("p", TTFTModel())
    eps = [endpoint("a", pending=4000, in_flight=9), endpoint("b")]
    assert scorer.score(request({"a": 250}), eps) == [1.0, 1.0]


def queued_holder_and_idle(coef, include_tokens: bool = False) -> tuple[float, float]:
    """The scores of an engine that holds 4,000 of the prompt's 4,096 tokens and has three
    requests awaiting their first token (six in flight, 1,500 tokens of prefill queued), and
    of an idle engine that holds none, under a model fitted to `coef`."""
    model = trained(coef)
    for _ in range(3):
        model.started("holder")
    scorer = PredictedLatencyScorer("p", model, include_tokens)
    eps = [endpoint("holder", pending=1500, in_flight=6), endpoint("idle")]
    holder, idle = scorer.score(request({"holder": 250}), eps)
    return holder, idle


def test_a_queue_is_priced_in_prompt_tokens_at_the_rate_the_fit_shows():
    """Host-bound (a queued request costs what ~40 uncached blocks do): the holder's queue is
    worth several prompts, and the idle engine scores far above it. GPU-bound (a request in
    flight costs what a few tokens do): the queue barely moves the score."""
    holder, idle = queued_holder_and_idle(HOST_BOUND)
    assert idle == 1.0 and holder < 0.25
    holder, idle = queued_holder_and_idle(GPU_BOUND)
    assert idle == 1.0 and holder > 0.95


def test_with_include_tokens_the_score_is_the_whole_predicted_time_to_first_token():
    """The holder computes 96 tokens, the idle engine 4,096: where prefill is the slow part the
    holder is predicted first, where the host is, the idle engine."""
    holder, idle = queued_holder_and_idle(GPU_BOUND, include_tokens=True)
    assert holder == 1.0 and 0.0 < idle < 0.5
    holder, idle = queued_holder_and_idle(HOST_BOUND, include_tokens=True)
    assert idle == 1.0 and 0.0 < holder < 0.5


def test_the_forward_reports_the_chosen_endpoints_first_token_on_the_callers_clock():
    model = TTFTModel(min_samples=1)
    scorer = PredictedLatencyScorer("p", model)
    a, b = endpoint("a", pending=2000, in_flight=3), endpoint("b")
    req = request({"a": 200})
    scorer.chosen(req, a)
    assert req.state.probe.endpoint == "a"
    assert req.state.probe.features == (1.0, 0.0, 2.0, 56 * 16 / 1000, 3)
    load = forward_load.sent(a, req, ApproximateIndex(), now=10.0)
    assert model.prefilling == {"a": 1}
    forward_load.prefilled(load, now=10.25)
    forward_load.prefilled(load, now=99.0)  # once only
    assert model.prefilling == {} and model.count == 1 and model.y[0] == 0.25
    forward_load.finished(load)
    assert model.count == 1 and model.prefilling == {}
    # another endpoint than the probe's (a retry's), or a decode leg (P/D): no probe started
    other = forward_load.sent(b, req, ApproximateIndex(), now=11.0)
    decode = forward_load.sent(a, req, ApproximateIndex(), computes_prompt=False, now=11.0)
    assert other.probe is None and decode.probe is None and model.prefilling == {}


def test_a_forward_that_ends_without_a_first_token_drops_its_probe_unreported():
    model = TTFTModel(min_samples=1)
    req = request({})
    a = endpoint("a")
    req.state.probe = Probe(model, "a", (1.0, 0.0, 0.0, 4.096, 0))
    load = forward_load.sent(a, req, ApproximateIndex())  # the router's clock: monotonic
    assert model.prefilling == {"a": 1}
    forward_load.finished(load)
    assert model.prefilling == {} and model.count == 0 and a.pending_prefill_tokens == 0


def test_the_scorer_is_configured_by_name_with_its_parameters():
    scorer = build_plugin(
        "predicted-latency-scorer",
        "lat",
        {"windowSamples": 64, "refitEvery": 4, "minSamples": 8, "refitIntervalSeconds": 0.2},
        None,
    )
    assert isinstance(scorer, PredictedLatencyScorer)
    m = scorer.model
    assert (m.window, m.refit_every, m.min_samples, m.refit_interval) == (64, 4, 8, 0.2)
    assert not scorer.include_tokens
    with pytest.raises(ValueError, match="windowSamples"):
        build_plugin("predicted-latency-scorer", "lat", {"windowSamples": 2}, None)
    with pytest.raises(ValueError, match="refitIntervalSeconds"):
        build_plugin("predicted-latency-scorer", "lat", {"refitIntervalSeconds": -1}, None)


class Held:
    """A prefix index with a fixed answer."""

    def __init__(self, answer: dict) -> None:
        self.answer = answer

    def longest_match(self, keys, endpoints=None) -> dict:
        return dict(self.answer)


def preset_pick(preset: str, coef) -> str:
    """What `preset` picks for a 4,096-token prompt whose context (all but 96 tokens, by both
    indexes) is held by an engine with three requests awaiting their first token, against an
    idle engine holding the shared first 1,024 tokens, its latency model fitted to `coef`."""
    ctx = SimpleNamespace(
        precise_index=Held({"holder": 250, "idle": 64}),
        approximate_index=Held({"holder": 250, "idle": 64}),
    )
    pipeline = Pipeline.preset(preset, ctx)
    eps = [endpoint("holder", pending=1500, in_flight=3), endpoint("idle")]
    for plugin in pipeline.plugins.values():
        if isinstance(plugin, PredictedLatencyScorer):
            plugin.model = trained(coef)
            for _ in range(3):
                plugin.model.started("holder")
    req = request({})
    return pipeline.schedule(req, eps).primary.name


def test_the_default_preset_spreads_a_queue_where_the_host_is_slow_and_follows_the_cache_else():
    assert preset_pick("kvmesh", HOST_BOUND) == "idle"
    assert preset_pick("kvmesh", GPU_BOUND) == "holder"
    # the preset without the scorer follows the cache whatever the fleet's times say
    assert preset_pick("kvmesh-affinity", HOST_BOUND) == "holder"


def test_the_affinity_preset_is_the_default_less_its_predicted_latency_scorer():
    kvmesh, affinity = (yaml.safe_load(PRESETS[n]) for n in ("kvmesh", "kvmesh-affinity"))
    assert [p for p in kvmesh["plugins"] if p["type"] != "predicted-latency-scorer"] == (
        affinity["plugins"]
    )
    refs = kvmesh["schedulingProfiles"][0]["plugins"]
    assert {"pluginRef": "predicted-latency-scorer", "weight": 32} in refs
    assert [r for r in refs if r["pluginRef"] != "predicted-latency-scorer"] == (
        affinity["schedulingProfiles"][0]["plugins"]
    )


def sim_run(policy: str, host_request_ms: float) -> tuple[FleetSim, list]:
    """12 agentic sessions of 4 turns (fan-outs of 4) on 4 emulated H100s in virtual time;
    with `host_request_ms`, a busy host: each step lasts at least 20 ms plus that per request
    running on its engine."""
    tokenizer = load_tokenizer(None)[0]
    host = 20.0 if host_request_ms else 0.0
    config = replay._configs("", 4, 0.1, 0, host_step_ms=host, host_request_ms=host_request_ms)
    sim = FleetSim(config, policy, tokenizer)
    return sim, sim.run(workload_requests(agentic(sessions=12, turns=4, fanout=4)))


def queue_price_tokens(sim: FleetSim) -> float:
    """What the fleet's fit says a queued request costs, in uncached prompt tokens."""
    (scorer,) = [p for p in sim.pipeline.plugins.values() if isinstance(p, PredictedLatencyScorer)]
    model = scorer.model
    assert model.prefilling == {} and model.count == len(sim.records)  # every probe reported
    c = model.coef
    return (c[1] + c[4]) / max(c[2], c[3]) * 1000


def max_over_mean(records) -> float:
    per = [0] * 4
    for r in records:
        per[r.engine] += 1
    return max(per) / (sum(per) / 4)


def test_in_virtual_time_the_preset_learns_what_a_queue_costs_and_spreads_on_a_busy_host():
    """GPU-bound, the fit prices a queued request at a few tokens and the preset places as it
    did without the scorer; host-bound, at over a thousand, and the preset spreads."""
    sim, records = sim_run("kvmesh", 0.0)
    assert queue_price_tokens(sim) < 100
    _, before = sim_run("kvmesh-affinity", 0.0)
    assert [r.engine for r in records] == [r.engine for r in before]
    sim, records = sim_run("kvmesh", 30.0)
    assert queue_price_tokens(sim) > 500
    _, before = sim_run("kvmesh-affinity", 30.0)
    assert max_over_mean(records) < max_over_mean(before) - 0.15
    with pytest.raises(ValueError, match="host-request-ms"):
        replay._configs("", 4, 0.1, 0, host_request_ms=-1.0)


def test_the_http_routers_charge_reports_the_first_token_of_a_probed_pick():
    from kvmesh.router.handlers import Charge

    model = TTFTModel(min_samples=1)
    a = endpoint("a")
    req = request({"a": 100})
    PredictedLatencyScorer("p", model).chosen(req, a)
    router = SimpleNamespace(approximate_index=ApproximateIndex())
    charge = Charge(router, req, a, None)
    assert model.prefilling == {"a": 1}
    charge.first_byte()
    charge.release()
    assert model.prefilling == {} and model.count == 1 and model.y[0] >= 0


def test_joined_with_the_placement_cost_a_fitted_scorer_totals_what_each_scores_alone():
    """Both read IN_FLIGHT's locals: joined into one profile function, each keeps its own."""
    ctx = SimpleNamespace(
        precise_index=Held({"a": 200, "b": 64}), approximate_index=Held({"a": 200})
    )
    pipeline = Pipeline.preset("kvmesh", ctx)
    profile = pipeline.profiles["default"]
    for scorer, _ in profile.scorers:
        if isinstance(scorer, PredictedLatencyScorer):
            scorer.model = trained(HOST_BOUND)
            scorer.model.started("a")
    eps = [endpoint("a", 900, 5), endpoint("b", 0, 1), endpoint("c", 100, 2)]
    req = request({})
    req.state = SchedulingState.of(req)
    req.state.look_up(req.block_keys, ["a", "b", "c"], ctx.precise_index, ctx.approximate_index)
    assert req.state.blocks_cached("a") == 200
    want = [0.0, 0.0, 0.0]
    for scorer, weight in profile.scorers:
        for i, x in enumerate(scorer.score(req, eps)):
            want[i] += weight * x
    totals, _ = profile.totals(req, eps)
    assert totals == pytest.approx(want, rel=1e-12)
    latency = [s for s, _ in profile.scorers if isinstance(s, PredictedLatencyScorer)][0]
    assert latency.score(req, eps)[0] < 0.5  # its fit is live in the joined function too
