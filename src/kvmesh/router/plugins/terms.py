"""A scorer's arithmetic as a *term*: Python source the pipeline joins with the other scorers of
a profile into one function per profile, run once per request.

Over the few endpoints of most fleets, a scorer's cost in Python is its call, its loop and its
list, not its arithmetic: nine scorers, each a method that loops over the endpoints and returns
a list, then a pass adding the weighted lists, cost several times what the additions do. A
profile's function has one loop that gathers what its scorers read of each endpoint and one
that scores and totals them; it keeps each scorer's scores only when asked to explain
(ProfileResult.scores: debug logs, tests). The source comes from the scorer classes alone: a
config's names, weights and parameters reach the function as values, never as source.

A term is the one definition of a scorer: ``TermScorer.score`` runs the same source alone, so a
scorer scores alike in and out of a profile, and a profile's totals are exactly the weighted
sum, in profile order, of its scorers' scores (tests hold all three equal).

The names a term's source may read: ``req``, ``state`` (req.state), ``endpoints``, ``n``
(their number, at least 1), and in the loops ``e`` (an endpoint), ``i`` (its index) and
``name`` (e.name); ``me``, the scorer itself; ``time`` and the functions it
names as helpers; and its own locals, spelled with a leading underscore (made unique per
scorer when joined).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from kvmesh.router.plugins.base import Plugin, SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.endpoints import Endpoint

# (req, endpoints) -> (each endpoint's weighted total, scorer name -> each endpoint's score
# when explaining, else None)
ProfileTotals = Callable[
    [SchedulingRequest, list], tuple[list[float], dict[str, list[float]] | None]
]


class Term(NamedTuple):
    score: str  # expression: the score of endpoint ``e`` (index ``i``), in [0, 1]
    setup: str = ""  # statements, once per pass, before the endpoints are gathered
    gather: str = ""  # statements, for each endpoint in order
    finish: str = ""  # statements, once per pass, after the gathering
    # expression, once per pass after finish: the score every endpoint gets this pass, or
    # None when they differ (then ``score`` is read per endpoint)
    uniform: str = ""
    helpers: tuple[Callable[..., Any], ...] = ()  # functions it calls, by their names


def spread_term(value: str) -> Term:
    """(max - v) / (max - min) of each endpoint's ``value`` (lower is better): 1 for the
    least, 0 for the most; 1.0 for all when all are equal, as every request finds an idle
    fleet. ``value``: statements that leave it in ``_x``, or an expression of ``e``. The
    least and the greatest are found as a loop of ``<`` and ``>`` from the first value, which
    is also their NaN rule."""
    gather = value if "_x =" in value else f"_x = {value}"
    return Term(
        setup="_v = []",
        gather=f"""{gather}
_v.append(_x)
if i == 0:
    _lo = _hi = _x
elif _x < _lo:
    _lo = _x
elif _x > _hi:
    _hi = _x""",
        finish="_span = _hi - _lo",
        uniform="1.0 if _hi == _lo else None",
        score="(_hi - _v[i]) / _span",
    )


CALL_SCORE = Term(setup="_s = me.score(req, endpoints)", score="_s[i]")  # a scorer without a term
_LOCAL = re.compile(r"(?<![\w.])_(?=[a-z])")
_NAME = re.compile(r"\bname\b")


def _own(source: str, k: int) -> str:
    """``source`` with its underscore locals and ``me`` made those of the k-th scorer."""
    return re.sub(r"\bme\b", f"me{k}", _LOCAL.sub(f"s{k}_", source))


def _block(source: str, indent: int) -> list[str]:
    return ["    " * indent + line for line in source.splitlines() if line.strip()]


def _loop(parts: list[str], head: list[str], tail: list[str]) -> list[str]:
    """A loop over the endpoints (``i`` counting them) running ``parts``."""
    lines = ["i = 0", "for e in endpoints:"]
    if any(_NAME.search(p) for p in parts):
        lines.append("    name = e.name")
    lines += head
    for part in parts:
        lines += _block(part, 1)
    return lines + tail + ["    i += 1"]


def _adds(k: int, term: Term, explain: bool) -> str:
    """Statements adding the k-th term's weighted score of endpoint ``e`` to ``t``."""
    score = f"x = {_own(term.score, k)}" + (f"\ns{k}.append(x)" if explain else "")
    score += f"\nt += w{k} * x"
    if not term.uniform:
        return score
    same = f"t += s{k}_add" + (f"\ns{k}.append(s{k}_uniform)" if explain else "")
    return f"if s{k}_add is None:\n{_indent(score)}\nelse:\n{_indent(same)}"


def _indent(source: str) -> str:
    return "\n".join("    " + line for line in source.splitlines())


def profile_source(terms: Sequence[Term], explain: bool) -> str:
    """``def make(me0.., w0.., n0..)``, returning the profile's ``run(req, endpoints)``;
    ``explain``: run also returns each scorer's scores (else None)."""
    k_all = range(len(terms))
    params = [f"me{k}" for k in k_all] + [f"w{k}" for k in k_all] + [f"n{k}" for k in k_all]
    body = ["state = req.state", "n = len(endpoints)"]
    for k, t in enumerate(terms):
        body += _block(_own(t.setup, k), 0)
    gathers = [_own(t.gather, k) for k, t in enumerate(terms) if t.gather]
    if gathers:
        body += _loop(gathers, [], [])
    for k, t in enumerate(terms):
        body += _block(_own(t.finish, k), 0)
        if t.uniform:  # the weighted score of every endpoint, when one for all
            body.append(f"s{k}_uniform = {_own(t.uniform, k)}")
            body.append(f"s{k}_add = None if s{k}_uniform is None else w{k} * s{k}_uniform")
    if explain:
        body += [f"s{k} = []" for k in k_all]
    body.append("out = []")
    adds = [_adds(k, t, explain) for k, t in enumerate(terms)]
    body += _loop(adds, ["    t = 0.0"], ["    out.append(t)"])
    scores = "{" + ", ".join(f"n{k}: s{k}" for k in k_all) + "}"
    body.append(f"return out, {scores if explain else 'None'}")
    lines = [f"def make({', '.join(params)}):", "  def run(req, endpoints):"]
    lines += ["    " + line for line in body]
    return "\n".join([*lines, "  return run"]) + "\n"


def compile_profile(scorers: Sequence[tuple[Any, float]], explain: bool = False) -> ProfileTotals:
    """The one function of a profile's (scorer, weight) pairs, in order."""
    terms = tuple(getattr(s, "term", None) or CALL_SCORE for s, _ in scorers)
    make = _MAKERS.get((terms, explain))
    if make is None:
        namespace: dict[str, Any] = {"time": time}
        namespace.update((f.__name__, f) for t in terms for f in t.helpers)
        source = profile_source(terms, explain)
        exec(compile(source, f"<profile of {len(terms)} scorers>", "exec"), namespace)
        make = _MAKERS[terms, explain] = namespace["make"]
    return make(
        *(s for s, _ in scorers), *(float(w) for _, w in scorers), *(s.name for s, _ in scorers)
    )


_MAKERS: dict[tuple[tuple[Term, ...], bool], Callable[..., ProfileTotals]] = {}


class TermScorer(Plugin):
    """A scorer defined by its ``term``; ``score`` runs it alone (the pipeline runs it joined
    with its profile's others)."""

    __slots__ = ()
    term: ClassVar[Term]

    def score(self, req: SchedulingRequest, endpoints: list[Endpoint]) -> list[float]:
        if not endpoints:
            return []
        name: str = self.name  # type: ignore[attr-defined]
        return compile_profile([(self, 1.0)], explain=True)(req, endpoints)[1][name]
