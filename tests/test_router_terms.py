"""A profile's scorers joined into one function (plugins.terms): its totals are exactly the
weighted sum, in profile order, of what each scorer scores alone, whatever the fleet's state."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.endpoints import Endpoint
from kvmesh.router.pipeline import PRESETS, Pipeline
from kvmesh.router.plugins import REGISTRY, SCORER, SchedulingRequest, SchedulingState
from kvmesh.router.plugins.terms import Term, TermScorer, compile_profile, profile_source

SCORERS = sorted(t.type_name for t in REGISTRY.values() if t.kind == SCORER)
PARAMS = {"prefill-backlog-scorer": {"scaleTokens": 96}, "token-load-scorer": {}}


class Fixed:
    """Prefix indexes with fixed answers."""

    def __init__(self, answer: dict) -> None:
        self.answer = answer

    def longest_match(self, keys, endpoints=None) -> dict:
        return {k: v for k, v in self.answer.items() if endpoints is None or k in endpoints}


class Indexes:
    def __init__(self, precise: dict, approx: dict) -> None:
        self.precise_index, self.approximate_index = Fixed(precise), Fixed(approx)


small = st.integers(min_value=0, max_value=3)  # few values: ties (uniform scores) are common
load = st.tuples(small, small, small, small, st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.2]))
fleet = st.lists(load, min_size=1, max_size=11)


def indexes_of(n: int, held, blocks: int) -> Indexes:
    """Indexes where endpoint e{i} holds (precise, approximate) blocks of the prompt's ``blocks``
    as ``held`` says (for the first ``n`` endpoints)."""
    precise = {f"e{i}": min(p, blocks) for i, p, _ in held if i < n and p}
    approx = {f"e{i}": min(a, blocks) for i, _, a in held if i < n and a}
    return Indexes(precise, approx)


def endpoints_of(loads) -> list[Endpoint]:
    out = []
    for i, (waiting, running, flight, tokens, kv) in enumerate(loads):
        e = Endpoint(f"http://e{i}:1", name=f"e{i}", waiting=waiting, kv_usage=kv)
        e.running, e.in_flight, e.in_flight_tokens = running, flight, tokens * 4096
        e.pending_prefill_tokens = (waiting * 37 + flight * 11) % 80
        out.append(e)
    return out


def yaml_of(weights: list[tuple[str, float]], thresholds: bool) -> str:
    plugins, refs = [], []
    for i, (type_name, weight) in enumerate(weights):
        params = dict(PARAMS.get(type_name, {}))
        if thresholds and type_name in (
            "precise-prefix-cache-scorer",
            "prefix-cache-scorer",
            "no-hit-lru-scorer",
        ):
            params["matchThreshold"] = 0.5
        plugins.append({"type": type_name, "name": f"s{i}", "parameters": params})
        refs.append({"pluginRef": f"s{i}", "weight": weight})
    return repr({"plugins": plugins, "schedulingProfiles": [{"name": "p", "plugins": refs}]})


@settings(max_examples=150, deadline=None)
@given(
    loads=fleet,
    chosen=st.lists(st.sampled_from(SCORERS), min_size=1, max_size=12),
    weights=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 8.0, -1.0]), min_size=12),
    held=st.lists(st.tuples(st.integers(0, 10), st.floats(0.0, 4.0), st.integers(0, 4))),
    blocks=st.integers(0, 4),
    thresholds=st.booleans(),
    session=st.sampled_from([None, "s1"]),
)
def test_joined_totals_are_the_weighted_sum_of_each_scorer_alone(
    loads, chosen, weights, held, blocks, thresholds, session
):
    endpoints = endpoints_of(loads)
    indexes = indexes_of(len(endpoints), held, blocks)
    pairs = list(zip(chosen, weights, strict=False))
    pipeline = Pipeline.from_yaml(yaml_of(pairs, thresholds), indexes)
    assert_totals_are_each_scorer_alone(pipeline.profiles["p"], endpoints, indexes, blocks, session)


PROFILED = sorted(n for n, text in PRESETS.items() if "scorer" in text)


@settings(max_examples=100, deadline=None)
@given(
    loads=fleet,
    preset=st.sampled_from(PROFILED),
    held=st.lists(st.tuples(st.integers(0, 10), st.floats(0.0, 4.0), st.integers(0, 4))),
    blocks=st.integers(0, 4),
    session=st.sampled_from([None, "s1"]),
)
def test_each_presets_profiles_total_each_scorer_alone(loads, preset, held, blocks, session):
    """The built-in presets' profiles as configured (their scorers, weights and thresholds,
    P/D's two profiles) total exactly what each of their scorers scores alone."""
    endpoints = endpoints_of(loads)
    indexes = indexes_of(len(endpoints), held, blocks)
    for profile in Pipeline.preset(preset, indexes).profiles.values():
        if profile.scorers:
            assert_totals_are_each_scorer_alone(profile, endpoints, indexes, blocks, session)


def assert_totals_are_each_scorer_alone(profile, endpoints, indexes, blocks, session) -> None:
    names = [e.name for e in endpoints]
    for scorer, _ in profile.scorers:  # some history: bound sessions, cold picks
        if hasattr(scorer, "bindings"):
            scorer.bindings["s1"] = (names[-1], float("inf"))
        if hasattr(scorer, "last_cold"):
            scorer.last_cold.update({n: i % 3 for i, n in enumerate(names[1:])})
    headers = {"x-session-id": session} if session else {}
    req = SchedulingRequest("r", None, list(range(blocks * 16 + 3)), list(range(blocks)), headers)
    req.state = SchedulingState.of(req)
    req.state.look_up(req.block_keys, names, indexes.precise_index, indexes.approximate_index)

    alone = [(w, s.score(req, endpoints)) for s, w in profile.scorers]
    want = []
    for i in range(len(endpoints)):
        t = 0.0
        for w, scores in alone:
            t += w * scores[i]
        want.append(t)
    totals, none = profile.totals(req, endpoints)
    assert none is None
    assert repr(totals) == repr(want)  # exactly (repr: NaN-safe), same additions in order
    totals, scores = profile.explained(req, endpoints)
    assert repr(totals) == repr(want)
    assert scores == {s.name: a for (s, _), (_, a) in zip(profile.scorers, alone, strict=True)}
    for score_list in scores.values():
        assert all(0.0 <= x <= 1.0 for x in score_list)


@dataclass(slots=True)
class Halves:
    """A scorer without a term: the profile calls its score."""

    name: str

    def score(self, req, endpoints) -> list[float]:
        return [0.5 if i % 2 else 1.0 for i in range(len(endpoints))]


@dataclass(slots=True)
class Ordinal(TermScorer):
    """A scorer defined by a term alone, with setup, gather, finish and a uniform score."""

    term = Term(
        setup="_names = []",
        gather="_names.append(name)",
        finish="_last = len(_names) - 1",
        uniform="1.0 if _last == 0 else None",
        score="i / _last",
    )
    name: str


def test_a_scorer_without_a_term_and_one_defined_by_a_term_join_a_profile():
    endpoints = endpoints_of([(0, 0, 0, 0, 0.0)] * 3)
    req = SchedulingRequest("r", None, [], [], {})
    req.state = SchedulingState.of(req)
    run = compile_profile([(Halves("h"), 2.0), (Ordinal("o"), 4.0)], explain=True)
    totals, scores = run(req, endpoints)
    assert scores == {"h": [1.0, 0.5, 1.0], "o": [0.0, 0.5, 1.0]}
    assert totals == [2.0, 3.0, 6.0]
    assert Ordinal("o").score(req, endpoints[:1]) == [1.0]  # uniform: one endpoint
    assert Ordinal("o").score(req, []) == []


def test_each_scorer_keeps_its_own_locals_when_joined():
    """Two scorers' `_x` are distinct names in the joined source; `me` is each one's own."""
    source = profile_source([Ordinal.term, Ordinal.term], explain=False)
    assert (
        "s0_names" in source
        and "s1_names" in source
        and "_names" not in source.replace("s0_names", "").replace("s1_names", "")
    )
    compile(source, "<test>", "exec")
