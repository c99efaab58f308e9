"""Expert load of a rank on /metrics, the group's imbalance, and EPLB rebalancing, all driven
after each lockstep step.

Series (labels model_name, engine, and `layer` = the ordinal among MoE layers):
- kvmesh:moe_expert_tokens_total{expert}: (token, expert) pairs this rank routed to each
  logical expert since load; the sum over engines is the group's expert load.
- kvmesh:moe_rank_tokens{dst_rank}: pairs this rank sent to each rank's expert slots since the
  last placement; summed over engines, each rank's share of the expert work.
- kvmesh:moe_imbalance: max / mean over ranks of the group's pairs per rank (1.0 = balanced),
  gathered every IMBALANCE_EVERY_STEPS lockstep steps (and the value each rebalance started
  from, until the next gather).
- kvmesh:eplb_rebalances_total: EPLB rebalances (--enable-eplb, every step_interval steps).
Invariant: every collective here runs on the engine thread at a lockstep step count all ranks
share, so all ranks make it together.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.engine.dp.eplb_config import EPLBConfig
from kvmesh.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)
IMBALANCE_EVERY_STEPS = 64


class ExpertLoadReporter:
    def __init__(self, model, metrics: EngineMetrics, eplb: EPLBConfig | None) -> None:
        from kvmesh.engine.models.eplb import EplbState

        self.model = model
        self.labels = metrics.labels
        self.log_balancedness = eplb is not None and eplb.log_balancedness
        self.eplb = EplbState(eplb.window_size, eplb.step_interval) if eplb else None
        names = list(self.labels)
        self.imbalance = Gauge(
            "kvmesh:moe_imbalance",
            "Max / mean over ranks of the (token, expert) pairs each rank's experts took "
            "(1.0 = balanced), over the whole group.",
            names,
            registry=metrics.registry,
        ).labels(**self.labels)
        self.imbalance.set(1.0)
        self.rebalances = Counter(
            "kvmesh:eplb_rebalances",
            "EPLB rebalances of the expert placement.",
            names,
            registry=metrics.registry,
        ).labels(**self.labels)
        metrics.registry.register(self)

    def after_step(self, num_steps: int) -> None:
        """On every rank after lockstep step `num_steps` (collective on some steps)."""
        from kvmesh.engine.models.eplb import expert_load

        if num_steps % IMBALANCE_EVERY_STEPS == 0:  # before EPLB resets the slot counts
            self.imbalance.set(expert_load(self.model, gather=True).imbalance)
        rebalanced = self.eplb.step(self.model) if self.eplb is not None else None
        if rebalanced is not None:
            self.rebalances.inc()
            self.imbalance.set(rebalanced.imbalance)  # until the next gather
            if self.log_balancedness:
                logger.info("EPLB rebalanced at imbalance %.3f", rebalanced.imbalance)

    def collect(self):
        """This rank's counts, read at scrape time (cumulative ints: a scrape mid-step sees
        the step's counts or not, never a torn total)."""
        from kvmesh.engine.models.eplb import expert_load

        load = expert_load(self.model)
        names = list(self.labels)
        values = list(self.labels.values())
        experts = CounterMetricFamily(
            "kvmesh:moe_expert_tokens",
            "(token, expert) pairs this rank routed to each logical expert.",
            labels=[*names, "layer", "expert"],
        )
        for layer, counts in enumerate(load.expert_counts):
            for expert, n in enumerate(counts):
                experts.add_metric([*values, str(layer), str(expert)], n)
        ranks = GaugeMetricFamily(
            "kvmesh:moe_rank_tokens",
            "(token, expert) pairs this rank sent to each rank's expert slots since the last "
            "placement.",
            labels=[*names, "layer", "dst_rank"],
        )
        for layer, counts in enumerate(load.rank_tokens):
            for rank, n in enumerate(counts):
                ranks.add_metric([*values, str(layer), str(rank)], n)
        return [experts, ranks]
