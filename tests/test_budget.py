"""The per-test time budget (tests/budget.py) fails a run with a phase past its budget, and names it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(folder: Path, *env_args: str) -> subprocess.CompletedProcess:
    (folder / "conftest.py").write_text(
        "from tests.budget import BudgetCheck\n"
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'budget(seconds, reason): allowed more')\n"
        "    config.pluginmanager.register(BudgetCheck(default=0.1), 'budget')\n"
    )
    (folder / "test_timed.py").write_text(
        "import time, pytest\n"
        "def test_quick():\n    pass\n"
        "@pytest.mark.budget(2, reason='sleeps on purpose')\n"
        "def test_exempt():\n    time.sleep(0.3)\n"
        "def test_slow():\n    time.sleep(0.3)\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **dict(a.split("=", 1) for a in env_args)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
        cwd=folder,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_phase_past_its_budget_fails_the_run_and_an_exemption_holds(tmp_path):
    done = run_pytest(tmp_path)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "3 passed" in done.stdout  # every test passed: the budget alone failed the run
    over = done.stdout.split("tests over their time budget")[1]
    assert "test_timed.py::test_slow (call)" in over and "budget 0.1 s" in over
    assert "test_exempt" not in over and "test_quick" not in over


def test_the_budget_can_be_reported_without_failing(tmp_path):
    done = run_pytest(tmp_path, "DUAL_SAMPLING_NO_BUDGET=1")
    assert done.returncode == 0 and "test_timed.py::test_slow (call)" in done.stdout, done.stdout[-2000:]
