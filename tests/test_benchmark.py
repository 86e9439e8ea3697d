"""Smoke test of the benchmark script: it runs end to end and writes every figure (no timing assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "benchmark.py"


def test_quick_benchmark_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(out)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["derived"]) == {
        "dual_vs_bound",
        "dual_vs_parallel_bound",
        "dual_vs_transformers",
        "dual_vs_recompute_at_1024",
        "per_token_growth",
        "growth_vs_teacher",
        "serve_vs_offline",
    }
    assert all(math.isfinite(v) and v > 0 for v in report["derived"].values())
    serve = report["results"]["serve"]
    assert serve["tok_s"] > 0 and 0 < serve["ttft_ms_p50"] <= serve["ttft_ms_p99"] and serve["itl_ms_p50"] > 0
    for design in ("teacher", "theta", "dual", "transformers", "recompute"):
        r = report["results"][design]
        assert r["tok_s"] > 0 and r["peak_rss_mib"] > 0
        assert all(v > 0 for v in r["time_per_token_ms"].values())
    split = report["results"]["dual"]["step_split_ms"]
    assert set(split) == {"total", "model", "barrier_wait", "mixing", "theta_waits_for_token", "theta_waits_for_plan"}
    assert split["total"] >= split["model"] > 0
    assert report["results"]["dual"]["split_steps"] == 0  # both engines hold the same batch at every step
    assert "dual_vs_bound" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 5000
