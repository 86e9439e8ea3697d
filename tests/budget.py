"""The per-test time budget: a test whose setup, call or teardown takes longer than its budget fails the run.

The suite's time is spent twice per change (a local run and CI), so it is held to a budget
test by test, not only in total. Every phase of a test (setup, with the fixtures it starts;
the call; teardown) gets :data:`DEFAULT_BUDGET_S` seconds. A test that needs more says so with
``@pytest.mark.budget(seconds, reason="...")``: the exemption names its figure and why the
test cannot be made cheaper. A session fixture's start is counted in the setup of the first test
that uses it, so an engine fixture's start must fit in that test's budget too.

The check runs on every ``pytest`` run of the whole suite and of any part of it; set
``DUAL_SAMPLING_NO_BUDGET=1`` to report without failing (a debugger, a loaded machine).
Budgets are wall-clock seconds on the 2-core CI machine, with room for its noise (the slowest
tests vary by ±20 % between runs).
"""

from __future__ import annotations

import os

import pytest

DEFAULT_BUDGET_S = 60.0
"""Seconds any phase of a test may take without an exemption."""


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
    """Collects each phase's duration and, at the end, fails the session for any phase past its test's budget."""

    def __init__(self, default: float = DEFAULT_BUDGET_S) -> None:
        self.default = default
        """Seconds per phase of a test without an exemption."""
        self.over: list[str] = []
        self.budgets: dict[str, float] = {}

    @pytest.hookimpl
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.budgets = {item.nodeid: budget_of(item, self.default) for item in items}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        budget = self.budgets.get(report.nodeid, self.default)
        if report.duration > budget:
            self.over.append(f"{report.nodeid} ({report.when}): {report.duration:.1f} s, budget {budget:g} s")

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.over:
            terminalreporter.section("tests over their time budget (tests/budget.py)")
            for line in self.over:
                terminalreporter.write_line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.over and not os.environ.get("DUAL_SAMPLING_NO_BUDGET") and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
