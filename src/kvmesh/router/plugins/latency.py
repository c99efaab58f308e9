"""Predicted latency: what each endpoint's queue adds to a request's time to first token, learnt
online from the router's own forwards (in the spirit of llm-d's predicted-latency, "SLO-aware",
scheduling).

At each pick the scorer records the chosen endpoint's features (FEATURES: what the router counts
there, and what this request lacks there); when that forward's first token comes,
router.forward_load reports the time it took (`TTFTModel.observed`). A least-squares fit of
time on features, every coefficient at least 0, over the last `window` reports and redone every
`refit_every` (and at most every `refit_interval` seconds: a fit is ~100 us, which at thousands
of requests a second would cost more than the rest of the scorer), says what each feature costs
on this fleet, not on a model of its GPUs.

Where prefill is the slow part, an uncached or queued token costs much and a queued request
little beyond its tokens; where the host is (engines starved of CPU, every engine step costing
host time whatever its tokens), a queued request costs as much as hundreds or thousands of
prompt tokens. The scorer prices each endpoint's queued requests in prompt tokens at that rate
(PredictedLatencyScorer), so it is about neutral in the first case and spreads, in the second,
what the cache scorers would pile onto one holder.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from textwrap import indent

import numpy as np

from kvmesh.router.plugins.base import PrefixReader, SchedulingRequest
from kvmesh.router.plugins.scorers import IN_FLIGHT
from kvmesh.router.plugins.terms import Term, TermScorer

logger = logging.getLogger(__name__)
# the features of (endpoint, request), in this order: a constant; requests sent there that have
# not had their first token (this router's count); prompt tokens waiting to be prefilled there
# (router.forward_load) and this request's uncached tokens there, in thousands; requests in
# flight there (scorers.IN_FLIGHT: the batch its prefill steps carry)
FEATURES = ("constant", "prefilling", "pending_prefill_ktokens", "uncached_ktokens", "in_flight")
MIN_SECONDS = 1e-6  # a prediction's floor: scores are ratios of predictions


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares coefficients of y on the columns of x, each at least 0: the unconstrained
    fit over the columns kept, dropping the most negative coefficient's column until none is
    negative. A column that never varied (but the first, the constant) gets 0: what it is worth
    cannot be told from the constant's. Solved on the normal equations, a system the size of
    the columns whatever the rows."""
    gram, xty = x.T @ x, x.T @ y
    varied = np.ptp(x, axis=0) > 0
    keep = [0, *(j for j in range(1, x.shape[1]) if varied[j])]
    coef = np.zeros(x.shape[1])
    while keep:
        sol = np.linalg.lstsq(gram[np.ix_(keep, keep)], xty[keep], rcond=None)[0]
        worst = int(np.argmin(sol))
        if sol[worst] >= 0:
            coef[keep] = sol
            break
        del keep[worst]
    return coef


@dataclass(slots=True)
class TTFTModel:
    """Time to first token as a linear function of FEATURES, fitted over the last `window`
    observations. Invariants: the last `count` (at most `window`) observations are held, each a
    row of the rings `x` (features) and `y` (seconds), the next written at `next_row`; `coef`
    is None until `min_samples` have been observed, then the fit of the rows held at the last
    refit, done at `fitted_at` (time.monotonic); `prefilling[name]` is the number of probes
    started on `name` and neither observed nor dropped."""

    window: int = 512
    refit_every: int = 32
    min_samples: int = 32
    refit_interval: float = 0.0  # seconds
    coef: tuple[float, ...] | None = None
    prefilling: dict[str, int] = field(default_factory=dict)
    x: np.ndarray = field(init=False, repr=False)
    y: np.ndarray = field(init=False, repr=False)
    count: int = field(default=0, init=False)
    next_row: int = field(default=0, init=False)
    since_fit: int = field(default=0, init=False)
    fits: int = field(default=0, init=False)
    fitted_at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if (
            self.window < len(FEATURES)
            or self.refit_every < 1
            or self.min_samples < 1
            or not self.refit_interval >= 0
        ):
            raise ValueError(
                f"windowSamples must be >= {len(FEATURES)}, refitEvery and minSamples >= 1, "
                "refitIntervalSeconds >= 0"
            )
        self.x = np.zeros((self.window, len(FEATURES)))
        self.y = np.zeros(self.window)

    def predict(self, features: tuple[float, ...]) -> float | None:
        """Seconds to first token (None: not fitted yet)."""
        coef = self.coef
        if coef is None:
            return None
        return max(MIN_SECONDS, sum(c * f for c, f in zip(coef, features, strict=True)))

    def started(self, endpoint: str) -> None:
        self.prefilling[endpoint] = self.prefilling.get(endpoint, 0) + 1

    def dropped(self, endpoint: str) -> None:
        """A started probe ended without a first token (failed, cancelled)."""
        left = self.prefilling.get(endpoint, 0) - 1
        if left > 0:
            self.prefilling[endpoint] = left
        else:
            self.prefilling.pop(endpoint, None)

    def observed(
        self, endpoint: str, features: tuple[float, ...], seconds: float, now: float | None = None
    ) -> None:
        """A started probe's first token came `seconds` after its forward was sent, at `now` on
        the clock that timed it (time.monotonic when None; the simulator's is virtual)."""
        self.dropped(endpoint)
        if not seconds >= 0:  # (NaN too) a clock that went back: nothing learnt
            return
        row = self.next_row
        self.x[row] = features
        self.y[row] = seconds
        self.next_row = (row + 1) % self.window
        if self.count < self.window:
            self.count += 1
        self.since_fit += 1
        if self.count >= self.min_samples and (
            self.coef is None
            or self.since_fit >= self.refit_every
            and (time.monotonic() if now is None else now) - self.fitted_at >= self.refit_interval
        ):
            self.refit(time.monotonic() if now is None else now)

    def refit(self, now: float | None = None) -> None:
        """Fit the rows held; `now`: when, on observed's clock (None: the time is not kept)."""
        n = self.count
        self.coef = tuple(float(c) for c in nonnegative_fit(self.x[:n], self.y[:n]))
        self.since_fit = 0
        self.fits += 1
        if now is not None:
            self.fitted_at = now
        if logger.isEnabledFor(logging.DEBUG):
            fit = ", ".join(f"{f} {c:.4g}" for f, c in zip(FEATURES, self.coef, strict=True))
            logger.debug("time to first token over %d forwards, s per unit: %s", n, fit)


@dataclass(slots=True)
class Probe:
    """One pick's chosen endpoint and its features then, reported to `model` by the forward
    that sends the request there (router.forward_load)."""

    model: TTFTModel
    endpoint: str
    features: tuple[float, ...]


@dataclass(slots=True)
class PredictedLatencyScorer(PrefixReader, TermScorer):
    """Scores each endpoint by the fleet's fitted TTFTModel; 1 everywhere until its first fit.
    Its pick's features go with the request (state.probe) for the forward to report.

    By default, the requests already on each endpoint (those awaiting their first token, those
    in flight), priced in prompt tokens at the fit's exchange rate (what they add to the time
    to first token over what a prompt token does): n / (n + Q - Qmin) for an n-token prompt, Q
    an endpoint's queue in tokens, as the placement cost scores its own tokens. Where prefill is
    the slow part a queued request is worth a few tokens and the score stays near 1 everywhere;
    where the host is, it is worth thousands and a long queue scores near 0. Prompt tokens,
    cached or pending, are left to the scorers that price them (prefix, placement): a second
    pull towards a prompt's holder packs sessions onto it (`kvmesh sim`'s closed loop lost a
    fifth of its output so).

    With `include_tokens`, the whole prediction: the best predicted time to first token over
    this endpoint's (1 for the fastest, 0.5 for one twice as slow)."""

    term = Term(
        setup="""_m = me.model
_cf = _m.coef
_pf = _m.prefilling
_tk = me.include_tokens
_u = state.uncached_of(endpoints) if _cf is not None and _tk else None
_p = []""",
        gather=f"""if _cf is not None:
    {indent(IN_FLIGHT, "    ").lstrip()}
    _r = _cf[1] * _pf.get(name, 0) + _cf[4] * _x
    if _tk:
        _r += _cf[0] + _cf[2] * e.pending_prefill_tokens / 1000 + _cf[3] * _u[i] / 1000
        _r = _r if _r > {MIN_SECONDS} else {MIN_SECONDS}
    _p.append(_r)""",
        finish="""if _p:
    _b = min(_p)
    if _tk:
        _n, _k = _b, 1.0
    else:
        _n = float(len(req.token_ids) or 1)
        _k = 1000.0 / max(_cf[2], _cf[3], 1e-9)""",
        uniform="1.0 if _cf is None else None",
        score="_n / (_n + (_p[i] - _b) * _k)",
    )

    name: str
    model: TTFTModel
    include_tokens: bool = False  # includeTokens

    def chosen(self, req: SchedulingRequest, endpoint) -> None:
        model, name, state = self.model, endpoint.name, req.state
        busy = endpoint.running + endpoint.waiting  # IN_FLIGHT
        x = (
            1.0,
            float(model.prefilling.get(name, 0)),
            endpoint.pending_prefill_tokens / 1000,
            state.uncached_tokens(name) / 1000,
            endpoint.in_flight if endpoint.in_flight > busy else busy,
        )
        state.probe = Probe(model, name, x)
