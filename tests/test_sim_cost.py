"""Cost per token of a simulated fleet against API list prices (kvmesh.sim.cost)."""

from __future__ import annotations

import copy
import json
import math
import tomllib
from datetime import date
from pathlib import Path

import pytest

from kvmesh.sim.cost import (
    ApiPrice,
    GpuHourPrice,
    PriceTable,
    api_comparison,
    fleet_cost,
    format_cost_table,
    load_price_table,
    plot_cost,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src" / "kvmesh" / "sim" / "api_prices.json"

# 4 GPUs for 2 h at $2.50 = $20; a quarter of it ($5) on 10M input tokens, $15 on 1M output.
RUN = dict(
    gpus=4,
    gpu_hour_usd=2.5,
    seconds=7200.0,
    input_tokens=10_000_000,
    cached_input_tokens=6_000_000,
    output_tokens=1_000_000,
    prefill_share=0.25,
)


def _table() -> PriceTable:
    api = ApiPrice("Acme", "Big", 3.0, 0.3, 15.0, "https://example.com/p", date(2026, 12, 1))
    gpu = GpuHourPrice("H100", 2.5, "test", "https://example.com/g", date(2026, 3, 1))
    return PriceTable(date(2026, 12, 6), (api,), {"H100": gpu})


def test_fleet_cost_hand_computed():
    c = fleet_cost(**RUN)
    assert c.total_usd == pytest.approx(20.0)
    assert c.input_usd == pytest.approx(5.0)
    assert c.output_usd == pytest.approx(15.0)
    assert c.usd_per_m_input == pytest.approx(0.5)  # $5 / 10M
    assert c.usd_per_m_output == pytest.approx(15.0)  # $15 / 1M
    assert c.usd_per_m_blended == pytest.approx(20.0 / 11.0)  # $20 / 11M


def test_prefill_share_splits_the_bill_not_the_total():
    all_decode = fleet_cost(**{**RUN, "prefill_share": 0.0})
    all_prefill = fleet_cost(**{**RUN, "prefill_share": 1.0})
    half = fleet_cost(**{**RUN, "prefill_share": 0.5})
    assert (all_decode.usd_per_m_input, all_decode.usd_per_m_output) == (0.0, pytest.approx(20.0))
    assert (all_prefill.usd_per_m_input, all_prefill.usd_per_m_output) == (pytest.approx(2.0), 0.0)
    assert (half.usd_per_m_input, half.usd_per_m_output) == (pytest.approx(1.0), pytest.approx(10))
    for c in (all_decode, all_prefill, half):
        assert c.total_usd == pytest.approx(20.0)
        assert c.usd_per_m_blended == pytest.approx(20.0 / 11.0)


def test_cost_scales_with_gpus_time_and_price():
    base = fleet_cost(**RUN).total_usd
    assert fleet_cost(**{**RUN, "gpus": 8}).total_usd == pytest.approx(2 * base)
    assert fleet_cost(**{**RUN, "seconds": 3600.0}).total_usd == pytest.approx(base / 2)
    assert fleet_cost(**{**RUN, "gpu_hour_usd": 5.0}).total_usd == pytest.approx(2 * base)


def test_api_comparison_prices_the_same_mix_and_the_ratio():
    (c,) = api_comparison(fleet_cost(**RUN), _table())
    # 4M uncached x $3 + 6M cached x $0.30 = $13.80; 1M output x $15 = $15; $28.80 in all.
    assert c.api_usd == pytest.approx(28.8)
    assert c.usd_per_m_input == pytest.approx(1.38)
    assert c.usd_per_m_output == pytest.approx(15.0)
    assert c.usd_per_m_blended == pytest.approx(28.8 / 11.0)
    assert c.ratio == pytest.approx(28.8 / 20.0)
    # No cache hits: all 10M input at $3 = $30, + $15 = $45 against the same $20 fleet.
    (cold,) = api_comparison(fleet_cost(**{**RUN, "cached_input_tokens": 0}), _table())
    assert cold.api_usd == pytest.approx(45.0)
    assert cold.ratio == pytest.approx(2.25)


@pytest.mark.parametrize(
    "bad",
    [
        {"gpus": 0},
        {"gpus": -1},
        {"gpus": 2.0},
        {"gpus": True},
        {"seconds": 0.0},
        {"seconds": -5.0},
        {"seconds": math.nan},
        {"seconds": math.inf},
        {"gpu_hour_usd": 0.0},
        {"gpu_hour_usd": -2.35},
        {"prefill_share": -0.01},
        {"prefill_share": 1.01},
        {"prefill_share": math.nan},
        {"input_tokens": 0},
        {"output_tokens": 0},
        {"output_tokens": -3},
        {"cached_input_tokens": -1},
        {"cached_input_tokens": 10_000_001},
    ],
)
def test_fleet_cost_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        fleet_cost(**{**RUN, **bad})


def test_shipped_price_file_loads_with_sources_and_dates():
    table = load_price_table()
    assert table == load_price_table(SHIPPED)
    assert table.apis and "H100" in table.gpu_hour
    for row in (*table.apis, *table.gpu_hour.values()):
        assert row.source.startswith("https://")
        assert isinstance(row.checked, date) and row.checked <= table.as_of
    for api in table.apis:
        assert api.provider and api.model
        assert 0 <= api.cached_input_usd_per_mtok <= api.input_usd_per_mtok
        assert api.input_usd_per_mtok < api.output_usd_per_mtok
    assert table.gpu_hour["H100"].usd_per_gpu_hour > 0


def test_price_file_is_package_data():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert "api_prices.json" in data["kvmesh.sim"]


def _mutate(fn):
    data = copy.deepcopy(json.loads(SHIPPED.read_text()))
    fn(data)
    return data


MALFORMED = {
    "missing output price": lambda d: d["apis"][0].pop("output_usd_per_mtok"),
    "missing source": lambda d: d["apis"][1].pop("source"),
    "price as text": lambda d: d["apis"][0].update(input_usd_per_mtok="4"),
    "negative price": lambda d: d["apis"][0].update(output_usd_per_mtok=-1.0),
    "cached above input": lambda d: d["apis"][0].update(cached_input_usd_per_mtok=99.0),
    "not a date": lambda d: d["apis"][0].update(checked="December 2026"),
    "plain http source": lambda d: d["apis"][0].update(source="http://example.com"),
    "unknown row key": lambda d: d["apis"][0].update(inptu_usd_per_mtok=1.0),
    "unknown top key": lambda d: d.update(extra=1),
    "no apis": lambda d: d.update(apis=[]),
    "row not an object": lambda d: d["apis"].append([1, 2, 3]),
    "bad as_of": lambda d: d.update(as_of=20261206),
    "gpu price zero": lambda d: d["gpu_hour"][0].update(usd_per_gpu_hour=0),
    "gpu twice": lambda d: d["gpu_hour"].append(dict(d["gpu_hour"][0])),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_price_file_is_refused(tmp_path, name):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(_mutate(MALFORMED[name])))
    with pytest.raises(ValueError):
        load_price_table(path)


def test_not_json_is_refused(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_price_table(path)


def test_table_text_has_rows_ratio_date_and_sources():
    table = _table()
    cost = fleet_cost(**RUN)
    text = format_cost_table(cost, api_comparison(cost, table), table)
    lines = text.splitlines()
    fleet_row = next(line for line in lines if line.startswith("kvmesh fleet"))
    assert fleet_row.split()[-5:] == ["0.500", "15.000", "1.818", "20.00", "1.0x"]
    api_row = next(line for line in lines if line.startswith("Acme Big"))
    assert api_row.split()[-5:] == ["1.380", "15.000", "2.618", "28.80", "1.4x"]
    assert "2026-12-06" in text
    assert "https://example.com/p (checked 2026-12-01)" in text
    assert "https://example.com/g" in text


def test_plot_writes_png(tmp_path):
    table = load_price_table()
    cost = fleet_cost(**RUN)
    out = plot_cost(cost, api_comparison(cost, table), tmp_path / "cost.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
