"""`kvmesh bench pd --quick` end to end: emulated engines, two routers, one JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_pd_bench(tmp_path):
    out = tmp_path / "pd"
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "pd", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((out / "pd.json").read_text())
    for name in ("aggregated 4", "P/D 2P+2D"):
        s = data[name]
        assert s["errors"] == 0 and s["requests"] == 8
        assert s["ttft_ms_p50"] > 0 and s["itl_ms_p50"] > 0 and s["e2e_ms_p90"] > 0
    assert (out / "pd.png").stat().st_size > 0
