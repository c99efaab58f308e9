"""The fleet of a `kvmesh sim` run from its flags: dense engines or MoE instances (--layout,
--gpus), the emulated model and GPU, and the engine flags of `kvmesh serve` (--serve-args, and the
few given as `kvmesh sim` flags, which win over them)."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator proper: fleet_config loads it, the flags do not
    from kvmesh.sim.fleet import FleetSimConfig

LAYOUT_MODEL = "glm-5.2-moe"  # the emulated model of --layout unless one is named
# serve flags on `sim`
ENGINE_FLAGS = ("emulate_model", "emulate_gpu", "speculative_config", "emulate_spec_acceptance")


def fleet_config(
    serve_args: str,
    engines: int,
    scrape: float,
    seed: int = 0,
    layout: str = "",
    gpus: int = 0,
    engine_flags: tuple[str, ...] = (),
    prefill_gpus: int = 0,
    kv_peer_min_cached_token_delta: int = 0,
    host_step_ms: float = 0.0,
    host_request_ms: float = 0.0,
) -> FleetSimConfig:
    """The fleet of --serve-args (and `engine_flags`, serve flags that win over them); with a
    layout the emulated model defaults to glm-5.2-moe. Raises ValueError for a layout that does
    not fit the model, or GPUs that do not divide into instances (or a prefill pool)."""
    from kvmesh.commands.flags import config_from_args
    from kvmesh.commands.serve_flags import serve_parser
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.emulation.config import EmulationConfig
    from kvmesh.sim.fleet import FleetSimConfig
    from kvmesh.sim.instances import instance_roofline

    # xxhash unless asked otherwise: the routing is the same, the replay much faster
    argv = ["--emulate", "--prefix-caching-hash-algo", "xxhash", *shlex.split(serve_args)]
    named = any(a.split("=")[0] == "--emulate-model" for a in [*argv, *engine_flags])
    if layout and not named:
        argv += ["--emulate-model", LAYOUT_MODEL]
    args = serve_parser().parse_args([*argv, *engine_flags])  # the flags `kvmesh serve` takes
    args.model = None if args.model == "default" else args.model
    config = FleetSimConfig(
        engines=engines,
        scrape_interval=scrape,
        seed=seed,
        layout=layout,
        gpus=gpus,
        prefill_gpus=prefill_gpus,
        kv_peer_min_cached_token_delta=kv_peer_min_cached_token_delta,
        host_step_s=host_step_ms / 1000,
        host_request_s=host_request_ms / 1000,
        engine=config_from_args(EngineConfig, args),
        emulation=config_from_args(EmulationConfig, args),
    )
    if config.layout:  # refuse a model that does not fit the layout before any run
        instance_roofline(config.layout, config.emulation, config.engine.expert_placement_strategy)
    return config


def add_fleet_args(g) -> None:
    g.add_argument(
        "--layout",
        default="",
        help="Serve an MoE --emulate-model as instances of this layout instead of dense "
        "engines: dpN = DPN/EPN wide EP (N GPUs, each a data-parallel rank with its own "
        "scheduler and KV cache; the experts spread over the N; the ranks step in lockstep, "
        "each step priced by the wide-EP roofline of `kvmesh bench ep`), tpN = TPN replicas "
        "(one rank over N GPUs). The router sees one endpoint per rank, <instance>#dp<rank>, "
        "as for a vLLM DP server, and a request runs on the rank it picks. --serve-args "
        "apply to every rank (--kv-offloading-size: host DRAM per rank). Empty: dense "
        "engines [default: dense].",
    )
    g.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="GPUs of the fleet: with --layout dpN or tpN, GPUs / N instances (N must divide "
        "it); dense, GPUs / --tensor-parallel-size engines. 0: --engines [default: 0].",
    )
    g.add_argument(
        "--prefill-gpus",
        type=int,
        default=0,
        help="P/D disaggregation: this many of the fleet's GPUs form a prefill pool of "
        "engines or --layout instances (it must divide into them), the rest a decode pool; "
        "their endpoints carry llm-d's role label (llm-d.ai/role: prefill | decode). Needs "
        "a P/D policy (--policies pd: the disagg profile handler picks a decode endpoint, and "
        "a prefill endpoint when the prompt tokens it lacks reach nonCachedTokens). The "
        "prefill endpoint runs a one-token copy of the request and holds its KV; the decode "
        "engine imports it (the engine's KV transfer, its link's time) and decodes with the "
        "prompt cached. 0: every engine serves whole requests [default: 0].",
    )
    g.add_argument(
        "--kv-peer-min-cached-token-delta",
        type=int,
        default=0,
        help="Peer sharing, as the router's flag of that name: when another engine holds at "
        "least this many more leading prompt tokens than the chosen one, the chosen engine "
        "pulls those blocks from it (the engine's KV transfer and its link's time) instead of "
        "recomputing them. 0: off [default: 0].",
    )
    g.add_argument(
        "--host-step-ms",
        type=float,
        default=0.0,
        help="A busy host: every engine step lasts at least this many ms plus "
        "--host-request-ms per request running on the engine, whatever the GPU's roofline "
        "says (engines starved of CPU, as beside `kvmesh bench up --hog`, where a step costs "
        "host time, not GPU time) [default: 0].",
    )
    g.add_argument(
        "--host-request-ms",
        type=float,
        default=0.0,
        help="With a busy host, the host ms each running request adds to a step [default: 0].",
    )
    g.add_argument(
        "--emulate-model",
        default=None,
        help="As `kvmesh serve --emulate-model` (wins over --serve-args) [default: "
        f"llama-3.1-8b; with --layout {LAYOUT_MODEL}].",
    )
    g.add_argument(
        "--emulate-gpu",
        default=None,
        help="As `kvmesh serve --emulate-gpu`: h100, h200, a100 (wins over --serve-args) "
        "[default: h100].",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help="As `kvmesh serve --speculative-config`, e.g. MTP with 3 drafts: "
        '\'{"method": "mtp", "num_speculative_tokens": 3}\'. The emulated drafts are accepted '
        "at the conditional rates per draft position of --emulate-spec-acceptance (in "
        "--serve-args; default 0.8,0.7,0.6: 2.70 tokens per step with 3) [default: off].",
    )
    g.add_argument(
        "--emulate-spec-acceptance",
        default=None,
        help="As `kvmesh serve --emulate-spec-acceptance` (wins over --serve-args): what an "
        "emulated MTP / EAGLE / draft-model draft is assumed to be worth, the chance each draft "
        "position is accepted given the ones before it were, comma-separated, the last "
        "repeating. An assumption, printed in the --ablation table: the default 0.8,0.7,0.6 is "
        "fitted to the llm-d GLM-5.2 guide's ~26 -> ~60 output tok/s per user with MTP 3 (the "
        "guide gives no acceptance rate); DeepSeek-V3's report measures 85-90%% for its one MTP "
        "draft. Edits of existing code accept more than free text [default: 0.8,0.7,0.6].",
    )


def kv_move_flags(args: argparse.Namespace) -> dict[str, float]:
    """The fleet_config keywords of the P/D, peer-sharing and busy-host flags."""
    return {
        "prefill_gpus": getattr(args, "prefill_gpus", 0) or 0,
        "kv_peer_min_cached_token_delta": getattr(args, "kv_peer_min_cached_token_delta", 0) or 0,
        "host_step_ms": getattr(args, "host_step_ms", 0.0) or 0.0,
        "host_request_ms": getattr(args, "host_request_ms", 0.0) or 0.0,
    }


def engine_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The serve flags given as `kvmesh sim` flags."""
    out: list[str] = []
    for name in ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            out += ["--" + name.replace("_", "-"), value]
    return tuple(out)
