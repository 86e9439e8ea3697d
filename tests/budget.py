"""The per-test time budget: every phase past its budget is reported; one far past it fails the run.

The suite's time is spent twice per change (a local run and CI), so it is held to a budget
test by test, not only in total. Every phase of a test (setup, with the fixtures it starts;
the call; teardown) gets :data:`DEFAULT_BUDGET_S` seconds. A test that needs more says so with
``@pytest.mark.budget(seconds, reason="...")``: the exemption names its figure and why the
test cannot be made cheaper. A session fixture's start is counted in the setup of the first test
that uses it, so an engine fixture's start must fit in that test's budget too.

Budgets are wall-clock seconds measured on one 2-core machine, and machines of that kind differ
by up to 2× (a fresh clone took 18.7 min on one and 32.7 min on another). So the budget is a
target, not a timed assertion: a phase past it is listed in the run's summary, and only a phase
past :data:`FAIL_FACTOR` times its budget fails the run. That catches a test that grew by an
order of magnitude (an engine started per test instead of per session, a hang cut short by a
timeout) and never a machine that is merely slower.

The check runs on every ``pytest`` run of the whole suite and of any part of it; set
``DUAL_SAMPLING_NO_BUDGET=1`` to report without failing (a debugger, a loaded machine).
"""

from __future__ import annotations

import os

import pytest

DEFAULT_BUDGET_S = 60.0
"""Seconds any phase of a test may take without an exemption (the target the summary reports against)."""

SLOW_MACHINE = 4.0
"""How much longer a step may take in CI than on an idle machine of our kind: the machines differ by up to 2×, and a
run may share its two cores with another job (2× again: a fresh clone's run took 114 min beside one). A limit on a
step whose time scales with the machine is its idle time times this, so a slower machine never reaches it, and a hang
(which never ends) still does."""

FAIL_FACTOR = SLOW_MACHINE + 1
"""A phase fails the run only past this multiple of its budget: room for a machine SLOW_MACHINE times slower, with its
noise."""

ENGINE_PAIR_START_S = 300.0
"""A limit on a process that starts a pair of engines before the awaited event: a pair starts in 32.5 s idle
(docs/testing.md), about 45 s through the CLI with its imports, times SLOW_MACHINE ≈ 180 s, with room for a few
batches after it. Below pytest-timeout's 900 s, so the limit and its message, not pytest, names the failure."""

SETTLE_S = 60.0
"""A limit on what a session left behind to end by itself (engines exiting after their driver, shared-memory files
removed): about 10 s idle (the engines' exit grace), times SLOW_MACHINE, rounded up."""


def budget_of(item: pytest.Item, default: float = DEFAULT_BUDGET_S) -> float:
    marker = item.get_closest_marker("budget")
    if marker is None:
        return default
    if not marker.args or not marker.kwargs.get("reason"):
        raise pytest.UsageError(
            f"{item.nodeid}: budget needs seconds and a reason: @pytest.mark.budget(90, reason=...)"
        )
    return float(marker.args[0])


class BudgetCheck:
    """Collects each phase's duration; at the end, lists the phases past their budget and fails the session for any
    past ``fail_factor`` times it."""

    def __init__(self, default: float = DEFAULT_BUDGET_S, fail_factor: float = FAIL_FACTOR) -> None:
        self.default = default
        """Seconds per phase of a test without an exemption."""
        self.fail_factor = fail_factor
        """Multiple of a budget past which a phase fails the run."""
        self.over: list[str] = []
        """Phases past their budget, as summary lines."""
        self.failing: list[str] = []
        """Phases past ``fail_factor`` times their budget (also in ``over``)."""
        self.budgets: dict[str, float] = {}

    @pytest.hookimpl
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.budgets = {item.nodeid: budget_of(item, self.default) for item in items}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        budget = self.budgets.get(report.nodeid, self.default)
        if report.duration <= budget:
            return
        line = f"{report.nodeid} ({report.when}): {report.duration:.1f} s, budget {budget:g} s"
        self.over.append(line)
        if report.duration > self.fail_factor * budget:
            self.failing.append(f"{line}, fails past {self.fail_factor * budget:g} s")

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.over:
            terminalreporter.section("tests over their time budget (tests/budget.py)")
            for line in self.over:
                terminalreporter.write_line(line)
        if self.failing:
            terminalreporter.section(f"tests over {self.fail_factor:g}x their time budget: the run fails")
            for line in self.failing:
                terminalreporter.write_line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.failing and not os.environ.get("DUAL_SAMPLING_NO_BUDGET") and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
