"""The fleets a plan considers: a layout (dense engines at a tensor-parallel size, or MoE
instances tpN / dpN), a number of them, aggregated or split into prefill and decode pools, a
routing preset, a host tier per engine (or DP rank) and MTP where the model ships MTP layers.

Every candidate is one `kvmesh sim` fleet (`fleet_config`); the enumeration leaves out layouts
whose weights do not fit the emulated GPU, so every candidate builds."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from kvmesh.engine.emulation.latency import ACCELERATORS, MODELS, RooflineLatency
from kvmesh.engine.emulation.layouts import build_roofline, layout_name, parse_layout
from kvmesh.sim.fleet import FleetSimConfig

DENSE_TP_SIZES = (1, 2, 4, 8)
MOE_LAYOUTS = ("tp8", "tp16", "dp8", "dp16", "dp32")
PD_PREFILL_SHARES = (1 / 4, 1 / 3, 1 / 2)  # of the fleet's engines or instances
PD_POLICY = "pd"
MTP_DRAFTS = 3
MTP_CONFIG = json.dumps({"method": "mtp", "num_speculative_tokens": MTP_DRAFTS})


@dataclass(slots=True, frozen=True)
class Candidate:
    """One fleet: `units` dense engines of `tp` GPUs (layout "") or instances of `layout`."""

    layout: str  # "": dense engines; "tpN" / "dpN": instances of an MoE model
    tp: int  # GPUs of one dense engine (--tensor-parallel-size); 0 with a layout
    units: int  # engines or instances, prefill ones included
    prefill_units: int  # 0: aggregated; else the prefill pool's engines or instances
    policy: str  # the router's preset
    host_tier_gib: int  # --kv-offloading-size per engine or DP rank; 0: none
    mtp: bool  # --speculative-config with MTP_DRAFTS drafts

    @property
    def gpus_per_unit(self) -> int:
        return parse_layout(self.layout)[1] if self.layout else self.tp

    @property
    def gpus(self) -> int:
        return self.units * self.gpus_per_unit

    @property
    def ranks_per_unit(self) -> int:
        """Endpoints (schedulers with their own KV cache) of one engine or instance."""
        if not self.layout:
            return 1
        kind, n = parse_layout(self.layout)
        return n if kind == "dp" else 1

    @property
    def decode_units(self) -> int:
        return self.units - self.prefill_units

    @property
    def family(self) -> tuple:
        """Everything but the size: more GPUs of a family are assumed to do no worse."""
        share = round(self.prefill_units / self.units, 2) if self.prefill_units else 0.0
        return (self.layout, self.tp, share, self.policy, self.host_tier_gib, self.mtp)

    def unit_name(self) -> str:
        return layout_name(*parse_layout(self.layout)) if self.layout else f"TP{self.tp}"

    def shape(self) -> str:
        """'2 x TP2' or '1 prefill + 2 decode DP16/EP16'."""
        name = self.unit_name()
        if self.prefill_units:
            return f"{self.prefill_units} prefill + {self.decode_units} decode {name}"
        return f"{self.units} x {name}"

    def techniques(self) -> str:
        parts = [f"{self.policy} routing"]
        if self.host_tier_gib:
            parts.append(f"host tier {self.host_tier_gib} GiB")
        if self.mtp:
            parts.append(f"MTP {MTP_DRAFTS}")
        return ", ".join(parts)

    def label(self) -> str:
        return f"{self.gpus} GPUs {self.shape()} ({self.techniques()})"

    def serve_args(self) -> str:
        words: list[str] = []
        if self.tp > 1:
            words += ["--tensor-parallel-size", str(self.tp)]
        if self.host_tier_gib:
            words += ["--kv-offloading-size", str(self.host_tier_gib)]
        return shlex.join(words)

    def fleet_config(
        self, model: str, gpu: str, seed: int = 0, acceptance: str = ""
    ) -> FleetSimConfig:
        """The `kvmesh sim` fleet of this candidate (MTP drafts accepted at `acceptance`, as
        --emulate-spec-acceptance takes it; "": its default)."""
        from kvmesh.sim.fleet_args import fleet_config

        flags: tuple[str, ...] = ("--emulate-model", model, "--emulate-gpu", gpu)
        if self.mtp:
            flags += ("--speculative-config", MTP_CONFIG)
            if acceptance:
                flags += ("--emulate-spec-acceptance", acceptance)
        prefill_gpus = self.prefill_units * self.gpus_per_unit
        return fleet_config(
            self.serve_args(), self.units, 0.1, seed, self.layout, self.gpus, flags, prefill_gpus
        )

    def to_dict(self) -> dict:
        return {
            "gpus": self.gpus,
            "layout": self.layout or f"tp{self.tp} dense",
            "shape": self.shape(),
            "units": self.units,
            "prefill_units": self.prefill_units,
            "policy": self.policy,
            "host_tier_gib": self.host_tier_gib,
            "mtp": self.mtp,
        }


def unit_layouts(model: str, gpu: str) -> list[tuple[str, int]]:
    """(layout, tp) of the units that hold `model` on `gpu`: dense TP sizes, or MoE layouts."""
    spec, card = MODELS[model], ACCELERATORS[gpu]
    out: list[tuple[str, int]] = []
    if not spec.num_experts:
        for tp in DENSE_TP_SIZES:
            try:
                RooflineLatency(card, spec, tp)
            except ValueError:
                continue
            out.append(("", tp))
        return out
    for layout in MOE_LAYOUTS:
        try:
            build_roofline(*parse_layout(layout), gpu, model)
        except ValueError:
            continue
        out.append((layout, 0))
    return out


def prefill_splits(units: int) -> list[int]:
    """Prefill pool sizes of a P/D split of `units` (each pool keeps at least one)."""
    if units < 2:
        return []
    sizes = {min(units - 1, max(1, round(units * share))) for share in PD_PREFILL_SHARES}
    return sorted(sizes)


def enumerate_candidates(
    model: str,
    gpu: str,
    max_gpus: int,
    policies: tuple[str, ...] = ("kvmesh",),
    host_tier_gib: int = 0,
    pd: bool = True,
) -> list[Candidate]:
    """Every fleet of at most `max_gpus` GPUs the plan considers, in ascending GPU count."""
    tiers = (0, host_tier_gib) if host_tier_gib else (0,)
    mtps = (False, True) if MODELS[model].num_nextn_predict_layers else (False,)
    out: list[Candidate] = []
    for layout, tp in unit_layouts(model, gpu):
        per = parse_layout(layout)[1] if layout else tp
        for units in range(1, max_gpus // per + 1):
            splits = [(0, p) for p in policies]
            if pd:
                splits += [(k, PD_POLICY) for k in prefill_splits(units)]
            for prefill, policy in splits:
                for tier in tiers:
                    for mtp in mtps:
                        out.append(Candidate(layout, tp, units, prefill, policy, tier, mtp))
    out.sort(key=lambda c: (c.gpus, c.prefill_units > 0, c.host_tier_gib, c.mtp))
    return out
