"""`kvmesh bench pd --quick` end to end, both modes: emulated engines, a router per
configuration, one JSON each. Asserts what the fleet did, not how fast it did it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_bench(out: Path, *flags: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "pd", "--quick", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_quick_pd_bench(tmp_path):
    out = tmp_path / "pd"
    run_bench(out)
    data = json.loads((out / "pd.json").read_text())
    for name in ("aggregated 4", "P/D 2P+2D"):
        s = data[name]
        assert s["errors"] == 0 and s["requests"] == 8
        assert s["ttft_ms_p50"] > 0 and s["itl_ms_p90"] >= s["itl_ms_p50"] > 0
        assert s["e2e_ms_p90"] > 0
    assert data["aggregated 4"]["disaggregated"] == 0
    # 600-token prompts never seen before: every one is over the threshold
    assert data["P/D 2P+2D"]["disaggregated"] == 8
    assert (out / "pd.png").stat().st_size > 0


def test_quick_agentic_pd_bench(tmp_path):
    out = tmp_path / "pd"
    run_bench(out, "--workload", "agentic")
    data = json.loads((out / "pd-agentic.json").read_text())
    requests = data["workload"]["requests"]
    for name in ("never", "always", "selective"):
        s = data[name]
        assert s["requests"] == requests and s["errors"] == 0, s["error_samples"]
        assert s["prefill_failed"] == 0
        assert s["ttft_ms_p50"] > 0 and s["itl_ms_p50"] > 0
    # the routers followed the engines' KV events (the decode-first choice reads them)
    assert not [n for n in data["notes"] if "precise index" in n], data["notes"]
    never, always, selective = (data[n]["disaggregated"] for n in ("never", "always", "selective"))
    assert never == 0
    assert always == requests
    # cold first turns go through a prefill engine; turns whose context the decode engine
    # holds (a tool output and an answer, ~120 tokens, under the 256-token threshold) do not
    assert 0 < selective < always
    # 2 prefill + 2 decode: the prefill engines answer no client request
    prefill_engines = data["engines"][:2]
    for name in ("always", "selective"):
        assert all(data[name]["load"].get(u, 0) == 0 for u in prefill_engines)
    assert (out / "pd-agentic.png").stat().st_size > 0
