"""Exact scores of each scheduling plugin, config parsing and presets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.endpoints import Endpoint
from kvmesh.router.pipeline import PRESETS, Pipeline, Profile
from kvmesh.router.plugins import (
    FILTER,
    HANDLER,
    PICKER,
    REGISTRY,
    SCORER,
    Plugin,
    SchedulingRequest,
    SchedulingState,
    build_plugin,
)


class Indexes:
    """The two prefix indexes as plugins see them, with fixed answers."""

    def __init__(self, precise=None, approx=None) -> None:
        self.precise_index = type("P", (), {"longest_match": lambda s, k, e=None: precise or {}})()
        self.approximate_index = type(
            "A", (), {"longest_match": lambda s, k, e=None: approx or {}}
        )()


def eps(**load) -> list[Endpoint]:
    out = []
    for name, (waiting, kv, inflight) in load.items():
        out.append(
            Endpoint(
                f"http://{name}:1", name=name, waiting=waiting, kv_usage=kv, in_flight=inflight
            )
        )
    return out


def req(nblocks: int = 4, headers=None) -> SchedulingRequest:
    return SchedulingRequest(
        "r", None, list(range(nblocks * 16)), list(range(nblocks)), headers or {}
    )


def with_state(r: SchedulingRequest, endpoints, ctx) -> SchedulingRequest:
    """r with its scheduling state as a pipeline pass fills it (both indexes looked up)."""
    r.state = SchedulingState.of(r)
    names = [e.name for e in endpoints]
    r.state.look_up(r.block_keys, names, ctx.precise_index, ctx.approximate_index)
    return r


def by_name(endpoints, scores) -> dict[str, float]:
    """A scorer's list (one score per endpoint, in order) keyed by endpoint name."""
    assert len(scores) == len(endpoints)
    return {e.name: s for e, s in zip(endpoints, scores, strict=True)}


def score(type_name: str, endpoints, r=None, ctx=None, params=None):
    ctx = ctx or Indexes()
    plugin = build_plugin(type_name, type_name, params or {}, ctx)
    return by_name(endpoints, plugin.score(with_state(r or req(), endpoints, ctx), endpoints))


def test_queue_scorer_min_max_normalised():
    e = eps(a=(0, 0, 0), b=(5, 0, 0), c=(10, 0, 0))
    assert score("queue-scorer", e) == {"a": 1.0, "b": 0.5, "c": 0.0}
    assert score("queue-scorer", eps(a=(3, 0, 0), b=(3, 0, 0))) == {"a": 1.0, "b": 1.0}


def test_kv_utilisation_and_load_aware():
    e = eps(a=(0, 0.25, 0), b=(64, 1.0, 0), c=(300, 0.0, 0))
    assert score("kv-cache-utilization-scorer", e) == {"a": 0.75, "b": 0.0, "c": 1.0}
    assert score("load-aware-scorer", e) == {"a": 0.5, "b": 0.25, "c": 0.0}


def test_prefill_backlog_follows_the_holder_until_its_queue_costs_more():
    """Cost = pending prefill + this request's uncached tokens; 1 for the least, linear to 0 at
    scaleTokens more. A 64-token prompt, 3 blocks cached on a (precise), 1 on b (approximate)."""
    ctx = Indexes(precise={"a": 3.0}, approx={"b": 1})
    e = eps(a=(0, 0, 0), b=(0, 0, 0), c=(0, 0, 0))
    got = score("prefill-backlog-scorer", e, ctx=ctx, params={"scaleTokens": 64})
    assert got == {"a": 1.0, "b": 0.5, "c": 0.25}  # uncached 16 / 48 / 64
    e[0].pending_prefill_tokens = 64  # a's queue now outweighs its cached prefix
    got = score("prefill-backlog-scorer", e, ctx=ctx, params={"scaleTokens": 64})
    assert got == {"a": 0.5, "b": 1.0, "c": 0.75}
    with pytest.raises(ValueError, match="scaleTokens"):
        score("prefill-backlog-scorer", e, params={"scaleTokens": 0})


def test_placement_cost_prices_the_recompute_and_the_batch_it_stalls():
    """Cost = pending prefill + uncached tokens x (1 + decodeWeight x requests in flight);
    scored (best + n) / (cost + n) for an n-token prompt. A 64-token prompt, 3 of its 4 blocks
    cached on a, nothing on b or c."""
    ctx = Indexes(precise={"a": 3.0})
    e = eps(a=(0, 0, 1), b=(0, 0, 0), c=(0, 0, 3))
    got = score("placement-cost-scorer", e, ctx=ctx)
    # costs 16 x 2 = 32, 64 x 1 = 64, 64 x 4 = 256: the holder of the context wins
    assert got == {"a": 1.0, "b": pytest.approx(96 / 128), "c": pytest.approx(96 / 320)}
    e[0].in_flight = 7  # a's batch is now so large that recomputing on idle b stalls less
    got = score("placement-cost-scorer", e, ctx=ctx)
    assert got == {"a": pytest.approx(128 / 192), "b": 1.0, "c": pytest.approx(128 / 320)}
    e[1].pending_prefill_tokens = 200  # ... unless b has much prefill queued
    got = score("placement-cost-scorer", e, ctx=ctx)
    assert got["a"] == 1.0 and got["b"] == pytest.approx(192 / 328)
    got = score("placement-cost-scorer", e, ctx=ctx, params={"decodeWeight": 0})
    assert got["a"] == 1.0 and got["c"] == pytest.approx(80 / 128)  # the wait alone: 16 vs 64
    e[1].pending_prefill_tokens = 0
    e[0].waiting = 2  # a's batch is full: two requests wait for a slot, each a whole prompt
    got = score("placement-cost-scorer", e, ctx=ctx, params={"decodeWeight": 0})
    assert got["b"] == 1.0 and got["a"] == pytest.approx(128 / (16 + 128 + 64))
    with pytest.raises(ValueError, match="decodeWeight"):
        score("placement-cost-scorer", e, params={"decodeWeight": -1})
    with pytest.raises(ValueError, match="waitingWeight"):
        score("placement-cost-scorer", e, params={"waitingWeight": -0.5})


def test_active_request_and_token_load():
    e = eps(a=(0, 0, 2), b=(0, 0, 6))
    assert score("active-request-scorer", e) == {"a": 1.0, "b": 0.0}
    e[0].in_flight_tokens, e[1].in_flight_tokens = 8192, 40000
    assert score("token-load-scorer", e, params={"queueThresholdTokens": 32768}) == {
        "a": 0.75,
        "b": 0.0,
    }


def test_precise_and_approximate_prefix_ratio():
    ctx = Indexes(precise={"a": 3.0, "b": 2.4}, approx={"b": 4})
    e = eps(a=(0, 0, 0), b=(0, 0, 0), c=(0, 0, 0))
    assert score("precise-prefix-cache-scorer", e, ctx=ctx) == {"a": 0.75, "b": 0.6, "c": 0.0}
    assert score("prefix-cache-scorer", e, ctx=ctx) == {"a": 0.0, "b": 1.0, "c": 0.0}


def test_session_affinity_binds_after_choice():
    plugin = build_plugin("session-affinity-scorer", "s", {}, Indexes())
    e = eps(a=(0, 0, 0), b=(0, 0, 0))
    r = req(headers={"x-session-id": "agent-7"})
    assert by_name(e, plugin.score(r, e)) == {"a": 0.0, "b": 0.0}
    plugin.chosen(r, e[1])
    assert by_name(e, plugin.score(r, e)) == {"a": 0.0, "b": 1.0}


def test_no_hit_lru_spreads_cold_requests_and_is_neutral_when_warm():
    plugin = build_plugin("no-hit-lru-scorer", "n", {}, Indexes())
    e = eps(a=(0, 0, 0), b=(0, 0, 0), c=(0, 0, 0))
    cold = with_state(req(), e, Indexes())
    plugin.chosen(cold, e[0])
    plugin.chosen(cold, e[1])
    assert by_name(e, plugin.score(cold, e)) == {"c": 1.0, "a": 0.5, "b": 0.0}
    warm = with_state(req(), e, Indexes(precise={"a": 1.0}))
    assert by_name(e, plugin.score(warm, e)) == {"a": 0.5, "b": 0.5, "c": 0.5}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-1, max_value=5), min_size=1, max_size=10))
def test_no_hit_lru_ranks_least_recent_first_stably_at_any_fleet_size(stamps):
    """Over a few endpoints ranks are counted, over more sorted: both are the stable order of
    last cold pick (never picked first), scored 1 - rank / (n - 1)."""
    plugin = build_plugin("no-hit-lru-scorer", "n", {}, Indexes())
    e = eps(**{f"e{i}": (0, 0, 0) for i in range(len(stamps))})
    plugin.last_cold.update({f"e{i}": s for i, s in enumerate(stamps) if s >= 0})
    order = sorted(range(len(stamps)), key=lambda i: stamps[i] if stamps[i] >= 0 else -1)
    n = max(1, len(stamps) - 1)
    want = {f"e{i}": 1.0 - rank / n for rank, i in enumerate(order)}
    assert by_name(e, plugin.score(with_state(req(), e, Indexes()), e)) == want


def test_filters():
    e = eps(a=(0, 0, 0), b=(0, 0, 0), c=(0, 0, 0))
    e[0].labels["llm-d.ai/role"] = "prefill"
    e[1].labels["llm-d.ai/role"] = "decode"
    decode = build_plugin("decode-filter", "d", {}, Indexes())
    assert [x.name for x in decode.filter(req(), e)] == ["b", "c"]
    sel = build_plugin(
        "label-selector-filter", "l", {"matchLabels": {"llm-d.ai/role": "prefill"}}, Indexes()
    )
    assert [x.name for x in sel.filter(req(), e)] == ["a"]


def test_weighted_pipeline_picks_best_total_and_reports_scores():
    yaml_text = """
plugins:
- {type: queue-scorer}
- {type: precise-prefix-cache-scorer, name: prefix}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 1}, {pluginRef: prefix, weight: 3}]
"""
    ctx = Indexes(precise={"b": 4.0})
    pipe = Pipeline.from_yaml(yaml_text, ctx)
    e = eps(a=(0, 0, 0), b=(4, 0, 0))
    assert pipe.schedule(req(), e).profiles["default"].scores == {}  # not explaining: totals
    pipe.explain = True
    result = pipe.schedule(req(), e)
    assert result.primary.name == "b"
    pr = result.profiles["default"]
    assert pr.totals == {"a": 1.0, "b": 3.0}
    assert pr.scores["prefix"] == {"a": 0.0, "b": 1.0}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_pick(name):
    pipe = Pipeline.preset(name, Indexes())
    e = eps(a=(0, 0, 0), b=(1, 0.5, 1))
    assert pipe.schedule(req(), e).primary.name in {"a", "b"}


@pytest.mark.parametrize("type_name", sorted(REGISTRY))
def test_every_plugin_type_is_registered_once_and_builds_on_its_defaults(type_name):
    """Filters, scorers, pickers and profile handlers alike: one table, type name to kind,
    parameters (with defaults) and factory."""
    t = REGISTRY[type_name]
    assert t.kind in (FILTER, SCORER, PICKER, HANDLER)
    third = {"decode": Profile("decode")} if t.kind == HANDLER else Indexes()
    plugin = build_plugin(type_name, "p", None, third)
    assert isinstance(plugin, Plugin) and plugin.name == "p"
    with pytest.raises(ValueError, match="unknown parameter nope; known"):
        build_plugin(type_name, "p", {"nope": 1}, third)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown plugin type"):
        Pipeline.from_yaml("plugins: [{type: nope}]", Indexes())
    with pytest.raises(ValueError, match="unknown plugin"):
        Pipeline.from_yaml("schedulingProfiles: [{name: d, plugins: [{pluginRef: x}]}]", Indexes())


def test_a_misspelt_parameter_is_refused_not_ignored():
    bad = "plugins: [{type: prefix-cache-scorer, parameters: {matchTreshold: 0.5}}]"
    with pytest.raises(ValueError, match="unknown parameter.*matchTreshold.*known: matchThreshold"):
        Pipeline.from_yaml(bad, Indexes())
    handler = """
plugins: [{type: disagg-profile-handler, parameters: {nonCached: 64}}, {type: decode-filter}]
schedulingProfiles: [{name: decode, plugins: [{pluginRef: decode-filter}]}]
"""
    with pytest.raises(ValueError, match="disagg-profile-handler: unknown parameter.*nonCached"):
        Pipeline.from_yaml(handler, Indexes())
    good = "plugins: [{type: prefix-cache-scorer, parameters: {matchThreshold: 0.5}}]"
    assert Pipeline.from_yaml(good, Indexes()).plugins["prefix-cache-scorer"].threshold == 0.5


async def test_endpoint_backoff_and_loss_after_repeated_failures():
    from kvmesh.router.endpoints import LOST_AFTER, EndpointPool
    from tests.helpers import free_port

    e = Endpoint(f"http://127.0.0.1:{free_port()}/v1")
    assert e.url.endswith(str(e.url.rsplit(":", 1)[1])) and not e.url.endswith("/v1")
    lost: list[str] = []
    pool = EndpointPool([e])
    pool.on_lost = lost.append
    for i in range(LOST_AFTER):
        await pool.scrape(e)
        assert not e.healthy and e.failures == i + 1
    assert lost == [e.name]
    assert e.retry_at > 0 and pool.candidates() == []


def test_profiles_without_prefix_plugins_skip_tokenizing_and_kv_events(tokenizer):
    from kvmesh.router.app import Router, RouterConfig

    def ctx():
        return Indexes()

    expect = {  # preset: (tokenizes, subscribes to KV events)
        "round-robin": (False, False),
        "random": (False, False),
        "load": (False, False),
        "approx-prefix": (True, False),
        "precise-prefix": (True, True),
        "kvmesh": (True, True),
        "pd": (True, True),
    }
    for name, flags in expect.items():
        pipeline = Pipeline.preset(name, ctx())
        assert (pipeline.reads_tokens, pipeline.reads_precise_index) == flags, name
    body = b'{"prompt": "' + b"a prompt long enough to fill blocks " * 8 + b'"}'
    for preset, encodes in (("round-robin", 0), ("kvmesh", 1)):
        router = Router(RouterConfig(["http://127.0.0.1:1"], preset=preset), tokenizer)
        req = router.scheduling_request(body, "/v1/completions", {})
        assert router.tokens.stats.encodes == encodes
        assert bool(req.block_keys) == bool(encodes) and bool(req.token_ids) == bool(encodes)
        with pytest.raises(ValueError):
            router.scheduling_request(b'{"prompt": 5}', "/v1/completions", {})
