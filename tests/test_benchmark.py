"""Smoke test of the benchmark script: it runs end to end and writes every figure (no timing assertions)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from tests import processes

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "benchmark.py"


def load_script():
    """The benchmark script as a module (dataclasses look their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.budget(
    150, reason="the script end to end: five designs, each starting its own engines: 69 s on an idle CI run"
)
def test_quick_benchmark_writes_json_table_and_plot(tmp_path, monkeypatch):
    """The script's own main(), in this process: its engines start from this session's fork server, not a fresh
    interpreter's (about 12 s of imports saved); what it writes is what a command line run writes."""
    out = tmp_path / "bench.json"
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as a script run puts its folder first: it imports bench_alpha
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--quick", "--output", str(out)])
    before = processes.snapshot()
    load_script().main()
    assert processes.settled(before) == (set(), set())  # every engine it started is closed, every file removed
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
    decision = report["decision"]
    assert decision["vocab"] == 49152 and decision["batch"] == 4
    assert 0 < decision["floor_us_per_row"] < decision["us_per_row"] < decision["reference_us_per_row"]
    assert decision["evaluations_per_row"] >= 2  # a warm start 0.07 off the root is never accepted as it is
    assert min(decision[f"{part}_us_per_row"] for part in ("read_pass", "evaluation", "first_evaluation")) > 0
    assert "dual_vs_bound" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 5000


def test_a_subset_of_designs_reports_only_the_figures_it_can():
    bench = load_script()
    s = bench.Settings("t", "h", lengths=[128, 1024], designs=("teacher", "theta", "dual"))
    results = {
        "teacher": {"tok_s": 100.0, "time_per_token_ms": {128: 5.0, 1024: 10.0}},
        "theta": {"tok_s": 200.0, "time_per_token_ms": {128: 4.0, 1024: 6.0}},
        "dual": {"tok_s": 90.0, "realistic_tok_s": 80.0, "time_per_token_ms": {128: 6.0, 1024: 11.0}},
        "serve": {"tok_s": 40.0},
    }
    derived = bench.derived_figures(s, results)
    assert set(derived) == {
        "dual_vs_bound",
        "dual_vs_parallel_bound",
        "per_token_growth",
        "growth_vs_teacher",
        "serve_vs_offline",
    }
    assert derived["dual_vs_parallel_bound"] == 0.9
    assert math.isclose(derived["dual_vs_bound"], 90.0 * (1 / 100 + 1 / 200))
    assert math.isclose(derived["growth_vs_teacher"], (11 / 6) / 2)
    assert derived["serve_vs_offline"] == 0.5
    with pytest.raises(ValueError, match="designs: unknown"):
        bench.Settings("t", "h", designs=("teacher", "vllm"))
