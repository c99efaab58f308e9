"""Cost per token of a simulated fleet, beside commercial API list prices.

A fleet is paid by the GPU-hour whether busy or idle: ``gpus x seconds / 3600 x price``. That bill
is split between input (prompt) and output (generated) tokens by ``prefill_share``, the fraction
of the fleet's busy GPU time spent on prefill work; idle time is split in the same proportion.
Input tokens count every prompt token, cached ones included; ``cached_input_tokens`` is the part
of them served from a prefix cache, which an API bills at its cheaper cache-read rate.

The API list prices and the default GPU-hour price live in ``api_prices.json`` beside this file,
each row with the page it was read from and the date it was checked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import date
from importlib import resources
from pathlib import Path

_M = 1_000_000
_API_SPEC = {"provider": str, "model": str, "input_usd_per_mtok": float,
             "cached_input_usd_per_mtok": float, "output_usd_per_mtok": float, "source": str,
             "checked": date}  # fmt: skip
_GPU_SPEC = {"gpu": str, "usd_per_gpu_hour": float, "basis": str, "source": str, "checked": date}


@dataclass(slots=True, frozen=True)
class ApiPrice:
    """One API's list prices in USD per million tokens, with where and when they were read."""

    provider: str
    model: str
    input_usd_per_mtok: float  # uncached prompt tokens
    cached_input_usd_per_mtok: float  # prompt tokens read from the provider's prompt cache
    output_usd_per_mtok: float
    source: str
    checked: date
    note: str = ""


@dataclass(slots=True, frozen=True)
class GpuHourPrice:
    """A public rental price of one GPU for one hour, and what kind of rental it is."""

    gpu: str
    usd_per_gpu_hour: float
    basis: str
    source: str
    checked: date
    note: str = ""


@dataclass(slots=True, frozen=True)
class PriceTable:
    """The price file: its date, the API rows and the GPU-hour prices by GPU name."""

    as_of: date
    apis: tuple[ApiPrice, ...]
    gpu_hour: dict[str, GpuHourPrice]


@dataclass(slots=True, frozen=True)
class FleetCost:
    """What a fleet run cost, and that cost per million input, output and all tokens."""

    gpus: int
    gpu_hour_usd: float
    seconds: float
    input_tokens: int  # all prompt tokens, cache hits included
    cached_input_tokens: int
    output_tokens: int
    prefill_share: float
    total_usd: float  # gpus x seconds / 3600 x gpu_hour_usd
    input_usd: float  # total_usd x prefill_share
    output_usd: float  # total_usd x (1 - prefill_share)
    usd_per_m_input: float  # input_usd per million input tokens
    usd_per_m_output: float  # output_usd per million output tokens
    usd_per_m_blended: float  # total_usd per million input + output tokens


@dataclass(slots=True, frozen=True)
class Comparison:
    """The run's token mix priced at one API's list prices, and API cost / fleet cost."""

    api: ApiPrice
    api_usd: float
    usd_per_m_input: float  # list prices averaged over the run's cached / uncached input
    usd_per_m_output: float
    usd_per_m_blended: float
    ratio: float  # api_usd / fleet total_usd: how many times dearer the API is


def _row(raw: object, spec: dict[str, type], where: str) -> dict:
    """Check one row against ``spec`` (key -> type) and return its values, dates parsed."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    if missing := spec.keys() - raw.keys():
        raise ValueError(f"{where}: missing {sorted(missing)}")
    if unknown := raw.keys() - spec.keys() - {"note"}:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    out = {}
    for key, kind in {**spec, "note": str}.items():
        value = raw.get(key, "")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        want = str if kind is date else kind
        if not isinstance(value, want) or (want is float and not math.isfinite(value)):
            raise ValueError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
        if kind is date:
            try:
                value = date.fromisoformat(value)
            except ValueError:
                raise ValueError(f"{where}: {key!r} is not an ISO date: {value!r}") from None
        elif kind is str and key != "note" and not value.strip():
            raise ValueError(f"{where}: {key!r} is empty")
        out[key] = value
    if "source" in out and not out["source"].startswith("https://"):
        raise ValueError(f"{where}: 'source' must be an https:// URL")
    return out


def load_price_table(path: str | Path | None = None) -> PriceTable:
    """Read and strictly check a price file (default: the shipped ``api_prices.json``).

    Raises ValueError naming the row and field of anything malformed or missing.
    """
    if path is None:
        text = resources.files("kvmesh.sim").joinpath("api_prices.json").read_text("utf-8")
    else:
        text = Path(path).read_text("utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"price file is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("price file: expected a JSON object")
    if unknown := data.keys() - {"as_of", "units", "apis", "gpu_hour"}:
        raise ValueError(f"price file: unknown keys {sorted(unknown)}")
    for key in ("apis", "gpu_hour"):
        if not isinstance(data.get(key), list) or not data[key]:
            raise ValueError(f"price file: {key!r} must be a non-empty list")
    apis = tuple(ApiPrice(**_row(r, _API_SPEC, f"apis[{i}]")) for i, r in enumerate(data["apis"]))
    for i, a in enumerate(apis):
        if not (a.input_usd_per_mtok > 0 and a.output_usd_per_mtok > 0
                and 0 <= a.cached_input_usd_per_mtok <= a.input_usd_per_mtok):  # fmt: skip
            raise ValueError(f"apis[{i}]: need input > 0, output > 0 and 0 <= cached <= input")
    gpus = [
        GpuHourPrice(**_row(r, _GPU_SPEC, f"gpu_hour[{i}]")) for i, r in enumerate(data["gpu_hour"])
    ]
    if any(g.usd_per_gpu_hour <= 0 for g in gpus) or len({g.gpu for g in gpus}) != len(gpus):
        raise ValueError("price file: each 'gpu_hour' GPU must appear once, at a price > 0")
    as_of = _row({"as_of": data.get("as_of")}, {"as_of": date}, "price file")["as_of"]
    return PriceTable(as_of, apis, {g.gpu: g for g in gpus})


def fleet_cost(
    gpus: int,
    gpu_hour_usd: float,
    seconds: float,
    input_tokens: int,
    cached_input_tokens: int,
    output_tokens: int,
    prefill_share: float,
) -> FleetCost:
    """Price a run of ``gpus`` GPUs for ``seconds`` at ``gpu_hour_usd`` per GPU-hour.

    ``input_tokens`` counts all prompt tokens (``cached_input_tokens`` of them were cache hits);
    ``prefill_share`` in [0, 1] is the fraction of busy GPU time spent on prefill, so input tokens
    carry that fraction of the bill and output tokens the rest. Raises ValueError on nonsense.
    """
    counts = {"gpus": gpus, "input_tokens": input_tokens, "output_tokens": output_tokens}
    for name, n in {**counts, "cached_input_tokens": cached_input_tokens}.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    if min(counts.values()) < 1:
        raise ValueError("need at least one GPU, one input token and one output token")
    if cached_input_tokens > input_tokens:
        raise ValueError("cached_input_tokens is part of input_tokens and cannot exceed it")
    if not (math.isfinite(gpu_hour_usd) and gpu_hour_usd > 0):
        raise ValueError(f"gpu_hour_usd must be > 0, got {gpu_hour_usd!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if not 0.0 <= prefill_share <= 1.0:  # also refuses NaN
        raise ValueError(f"prefill_share must be in [0, 1], got {prefill_share!r}")
    total = gpus * seconds / 3600.0 * gpu_hour_usd
    in_usd, out_usd = total * prefill_share, total * (1.0 - prefill_share)
    per_m = (in_usd / input_tokens * _M, out_usd / output_tokens * _M)
    blended = total / (input_tokens + output_tokens) * _M
    return FleetCost(gpus, gpu_hour_usd, seconds, input_tokens, cached_input_tokens, output_tokens,
                     prefill_share, total, in_usd, out_usd, *per_m, blended)  # fmt: skip


def api_comparison(cost: FleetCost, table: PriceTable) -> list[Comparison]:
    """Price the run's token mix at each API's list prices, in the price file's order.

    Uncached input is billed at the API's input price, cached input at its cache-read price and
    output at its output price; ``ratio`` is that bill over the fleet's ``total_usd``.
    """
    uncached, cached = cost.input_tokens - cost.cached_input_tokens, cost.cached_input_tokens
    tokens = cost.input_tokens + cost.output_tokens
    out = []
    for api in table.apis:
        in_usd = (uncached * api.input_usd_per_mtok + cached * api.cached_input_usd_per_mtok) / _M
        usd = in_usd + cost.output_tokens * api.output_usd_per_mtok / _M
        per_m_in = in_usd / cost.input_tokens * _M
        per_m_out, ratio = api.output_usd_per_mtok, usd / cost.total_usd
        out.append(Comparison(api, usd, per_m_in, per_m_out, usd / tokens * _M, ratio))
    return out


def format_cost_table(cost: FleetCost, comparisons: list[Comparison], table: PriceTable) -> str:
    """A plain-text table of $/M for the fleet and each API, with the price sources under it."""
    head = f"{'':34}{'$/M in':>9}{'$/M out':>9}{'$/M all':>9}{'run $':>11}{'API/fleet':>11}"
    fleet = f"kvmesh fleet ({cost.gpus} GPU @ ${cost.gpu_hour_usd:.2f}/h)"
    lines = [
        head,
        f"{fleet:34}{cost.usd_per_m_input:9.3f}{cost.usd_per_m_output:9.3f}"
        f"{cost.usd_per_m_blended:9.3f}{cost.total_usd:11.2f}{'1.0x':>11}",
    ]
    for c in comparisons:
        name = f"{c.api.provider} {c.api.model}"[:33]
        lines.append(
            f"{name:34}{c.usd_per_m_input:9.3f}{c.usd_per_m_output:9.3f}"
            f"{c.usd_per_m_blended:9.3f}{c.api_usd:11.2f}{c.ratio:10.1f}x"
        )
    hit = cost.cached_input_tokens / cost.input_tokens
    lines += [
        "",
        f"{cost.input_tokens:,} input tokens ({hit:.1%} cached), {cost.output_tokens:,} output; "
        f"{cost.gpus} GPUs x {cost.seconds / 3600:.3f} h; prefill share {cost.prefill_share:.2f}",
        "API $/M in is the list price averaged over this run's cached / uncached input.",
        f"Prices as of {table.as_of.isoformat()}; sources:",
    ]
    for a in table.apis:
        lines.append(f"  {a.provider} {a.model}: {a.source} (checked {a.checked.isoformat()})")
    for g in table.gpu_hour.values():
        lines.append(
            f"  {g.gpu} ${g.usd_per_gpu_hour:.2f}/GPU-hour, {g.basis}: {g.source} "
            f"(checked {g.checked.isoformat()})"
        )
    return "\n".join(lines)


def plot_cost(cost: FleetCost, comparisons: list[Comparison], path: str | Path) -> Path:
    """Bar chart of $/M input and output tokens, fleet beside each API (log scale), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["kvmesh fleet"] + [f"{c.api.provider}\n{c.api.model}" for c in comparisons]
    ins = [cost.usd_per_m_input] + [c.usd_per_m_input for c in comparisons]
    outs = [cost.usd_per_m_output] + [c.usd_per_m_output for c in comparisons]
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(names)), 4.5))
    ax.bar([x - 0.2 for x in xs], ins, width=0.4, label="$/M input tokens")
    ax.bar([x + 0.2 for x in xs], outs, width=0.4, label="$/M output tokens")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("USD per million tokens")
    ax.set_title(f"cost per token: {cost.gpus} GPUs at ${cost.gpu_hour_usd:.2f}/GPU-hour vs APIs")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
