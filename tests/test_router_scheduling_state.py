"""The per-request scheduling state: prefix matches looked up once, before any filter, over every
candidate endpoint, and read by every profile, scorer and the disagg handler alike."""

from __future__ import annotations

from types import SimpleNamespace

from kvmesh.protocol.kv_events import BlockStored, KVEventBatch
from kvmesh.router.approx_index import ApproximateIndex
from kvmesh.router.endpoints import Endpoint
from kvmesh.router.index import PreciseIndex
from kvmesh.router.pipeline import Pipeline
from kvmesh.router.plugins import NO_MATCH, SchedulingRequest, SchedulingState

ROLE = "llm-d.ai/role"
BLOCK = 128  # four blocks: a 512-token prompt, above the pd preset's nonCachedTokens (256)


def role_endpoints() -> list[Endpoint]:
    out = []
    for name, role in (("d1", "decode"), ("d2", "decode"), ("p1", "prefill"), ("p2", "prefill")):
        e = Endpoint(f"http://{name}:8000", name=name)
        e.labels[ROLE] = role
        out.append(e)
    return out


def pd_request() -> SchedulingRequest:
    keys = [101, 102, 103, 104]
    return SchedulingRequest("r", None, list(range(4 * BLOCK)), keys, {}, BLOCK)


def indexes_with_p1_holding(keys: list[int]) -> SimpleNamespace:
    precise = PreciseIndex()
    stored = BlockStored(keys, None, [], BLOCK, None, "GPU", None)
    precise.apply("p1", KVEventBatch(0.0, [stored]))
    return SimpleNamespace(precise_index=precise, approximate_index=ApproximateIndex())


def test_pd_prefill_profile_follows_the_prefill_endpoint_that_holds_the_prompt():
    """The decode profile runs first over decode endpoints; the prefill profile must still see
    what prefill endpoints cache (the match is looked up over all candidates, not over the
    endpoints the first scorer saw)."""
    req = pd_request()
    ctx = indexes_with_p1_holding(req.block_keys)
    pipeline = Pipeline.preset("pd", ctx)
    pipeline.explain = True
    result = pipeline.schedule(req, role_endpoints())
    assert result.primary is not None and result.primary.name in ("d1", "d2")
    assert result.prefill is not None and result.prefill.name == "p1"
    prefill = result.profiles["prefill"]
    assert prefill.scores["precise-prefix-cache-scorer"] == {"p1": 1.0, "p2": 0.0}


def test_pd_decode_pick_that_holds_the_prompt_skips_prefill():
    """The disagg threshold reads the same uncached-token count as every other reader."""
    req = pd_request()
    ctx = indexes_with_p1_holding(req.block_keys)
    ctx.precise_index.apply(
        "d2", KVEventBatch(0.0, [BlockStored(req.block_keys, None, [], BLOCK, None, "GPU", None)])
    )
    result = Pipeline.preset("pd", ctx).schedule(req, role_endpoints())
    assert result.primary.name == "d2" and result.prefill is None
    assert "prefill" not in result.profiles


class CountingIndex:
    """An index with fixed answers that records the endpoint names of every lookup."""

    def __init__(self, hits: dict[str, float]) -> None:
        self.hits, self.calls = hits, []

    def longest_match(self, keys, names):
        self.calls.append(list(names))
        return {n: h for n, h in self.hits.items() if n in names}


class NoLookups:
    def longest_match(self, keys, names):
        raise AssertionError("a pipeline that reads no index looked one up")


def test_each_index_is_looked_up_once_per_pass_over_every_candidate():
    precise, approx = CountingIndex({"p1": 4.0}), CountingIndex({})
    ctx = SimpleNamespace(precise_index=precise, approximate_index=approx)
    result = Pipeline.preset("pd", ctx).schedule(pd_request(), role_endpoints())
    assert result.prefill is not None and result.prefill.name == "p1"  # both profiles ran
    assert [sorted(c) for c in precise.calls] == [["d1", "d2", "p1", "p2"]]
    assert [sorted(c) for c in approx.calls] == [["d1", "d2", "p1", "p2"]]


def test_pipelines_that_read_no_index_look_none_up():
    ctx = SimpleNamespace(precise_index=NoLookups(), approximate_index=NoLookups())
    for preset in ("round-robin", "random", "load"):
        req = pd_request()
        assert Pipeline.preset(preset, ctx).schedule(req, role_endpoints()).primary is not None
        assert req.state.precise is NO_MATCH and req.state.approximate is NO_MATCH
        assert req.state.uncached_tokens("d1") == 4 * BLOCK  # nothing known cached


def test_capabilities_come_from_the_plugins_a_pipeline_uses():
    ctx = SimpleNamespace(precise_index=NoLookups(), approximate_index=NoLookups())

    def caps(*types: str) -> tuple[bool, bool, bool]:
        plugins = ", ".join(f"{{type: {t}}}" for t in types)
        refs = ", ".join(f"{{pluginRef: {t}}}" for t in types)
        text = f"plugins: [{plugins}]\nschedulingProfiles: [{{name: default, plugins: [{refs}]}}]"
        p = Pipeline.from_yaml(text, ctx)
        return p.reads_tokens, p.reads_precise_index, p.reads_approximate_index

    assert caps("queue-scorer", "session-affinity-scorer") == (False, False, False)
    assert caps("token-load-scorer") == (True, False, False)  # in-flight tokens of prompts
    assert caps("prefix-cache-scorer") == (True, False, True)
    assert caps("precise-prefix-cache-scorer") == (True, True, False)
    assert caps("no-hit-lru-scorer") == (True, True, True)
    assert caps("placement-cost-scorer") == (True, True, True)
    # a plugin defined but in no profile reads nothing
    text = "plugins: [{type: prefix-cache-scorer}, {type: random-picker}]\n"
    text += "schedulingProfiles: [{name: default, plugins: [{pluginRef: random-picker}]}]"
    assert not Pipeline.from_yaml(text, ctx).reads_tokens


def test_uncached_tokens_have_one_rounding_rule_that_the_disagg_threshold_reads():
    """3.8 blocks of 16 cached (the last one on the CPU tier, weighed 0.8) leave 5 of the 65
    prompt tokens uncached: P/D runs at nonCachedTokens 5, not at 6."""
    state = SchedulingState(65, 16, 4, {"d1": 3.8}, NO_MATCH)
    assert state.uncached_tokens("d1") == 5 and state.uncached_tokens("p1") == 65
    config = """
plugins:
- {type: disagg-profile-handler, parameters: {nonCachedTokens: %d}}
- {type: decode-filter}
- {type: prefill-filter}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}]}
"""
    eps = [e for e in role_endpoints() if e.name in ("d1", "p1")]
    for threshold, prefill in ((5, "p1"), (6, None)):
        ctx = SimpleNamespace(
            precise_index=CountingIndex({"d1": 3.8}), approximate_index=CountingIndex({})
        )
        req = SchedulingRequest("r", None, list(range(65)), [1, 2, 3, 4], {}, 16)
        result = Pipeline.from_yaml(config % threshold, ctx).schedule(req, eps)
        assert result.primary.name == "d1"
        assert (result.prefill and result.prefill.name) == prefill, threshold


def test_peer_source_reads_the_pass_state_and_names_only_other_servers():
    """The pass looked the precise index up over every candidate, a sibling rank of the chosen
    server included: selection reads that match, looks nothing up again, and never names the
    sibling."""
    from kvmesh.router.peer_source import PeerSourceConfig, select_source

    chosen = Endpoint("http://a:1", "a#dp0", dp_rank=0)
    sibling = Endpoint("http://a:1", "a#dp1", dp_rank=1)
    b = Endpoint("http://b:2")
    precise = CountingIndex({"a#dp1": 20.0, "http://b:2": 12.0})
    ctx = SimpleNamespace(precise_index=precise, approximate_index=ApproximateIndex())
    text = "plugins: [{type: precise-prefix-cache-scorer}]\nschedulingProfiles: [{name: default,"
    text += " plugins: [{pluginRef: precise-prefix-cache-scorer}]}]"
    req = SchedulingRequest("r", None, list(range(320)), list(range(20)), {})
    Pipeline.from_yaml(text, ctx).schedule(req, [chosen, sibling, b])
    assert [sorted(c) for c in precise.calls] == [["a#dp0", "a#dp1", "http://b:2"]]
    source = select_source(precise, [chosen, sibling, b], chosen, req, PeerSourceConfig(64))
    assert source is not None and source.endpoint is b and source.lead_tokens == 192
    assert len(precise.calls) == 1


def test_what_endpoints_hold_is_derived_again_when_a_match_is_replaced():
    state = SchedulingState(65, 16, 4, {"d1": 3.8, "d2": 1.0}, {"d2": 2, "p1": 1})
    assert state.blocks_cached("d1") == 3.8 and state.blocks_cached("d2") == 2
    assert state.best_blocks() == 3.8 and state.uncached_tokens("p1") == 49
    assert state.blocks_cached("p2") == 0.0 and state.uncached_tokens("p2") == 65
    state.precise = {"p2": 4.0}  # a later reader filled it anew
    assert state.best_blocks() == 4.0 and state.uncached_tokens("p2") == 1
    assert state.blocks_cached("d1") == 0.0 and state.blocks_cached("d2") == 2
    empty = SchedulingState(65, 16, 4, NO_MATCH, NO_MATCH)
    assert empty.best_blocks() == 0 and empty.best_fraction() == 0.0
    assert empty.uncached_tokens("d1") == 65


def test_the_block_of_a_whole_block_prompt_s_last_token_is_never_counted_cached():
    """An engine computes the prompt's last token whatever it holds (vLLM reports
    prompt - block_size cached tokens for a repeated prompt of whole blocks): every reader
    sees at most all but the last block of such a prompt as cached."""
    for held, expect in ((4.0, 3), (3.8, 3), (3.0, 3), (2.5, 2.5)):
        state = SchedulingState(64, 16, 4, {"d1": held}, {"d2": 4})
        assert state.blocks_cached("d1") == expect and state.blocks_cached("d2") == 3
        assert state.uncached_tokens("d1") == 64 - int(expect * 16)
        assert state.uncached_tokens("d2") == 16 and state.best_blocks() == 3
    one = SchedulingState(16, 16, 1, {"d1": 1.0}, NO_MATCH)  # a one-block prompt: nothing
    assert one.blocks_cached("d1") == 0 and one.uncached_tokens("d1") == 16
    assert SchedulingState(0, 16, 0, {"d1": 1.0}, NO_MATCH).uncached_tokens("d1") == 0
