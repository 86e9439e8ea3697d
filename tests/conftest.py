"""Shared fixtures (real vLLM CPU engines on the tiny models, started once per session) and the test tiers.

Every test phase has a time budget (``tests/budget.py``); ``@pytest.mark.budget`` names the exceptions.

Tiers: ``engine`` marks every test that starts engines (directly, through a fixture, or in
a subprocess); ``models`` marks tests that build the real SmolLM2 folders. ``make test-fast``
runs the rest in a few minutes; CI runs everything.

Hypothesis runs derandomized (the same examples every run); set HYPOTHESIS_PROFILE=explore
to search new ones.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from dual_sampling.testing import tiny_models
from tests import processes  # tags every process this session starts, before any starts
from tests.budget import BudgetCheck

settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

ENGINE_FIXTURES = {"dual_engine", "load_engine"}


def pytest_configure(config):
    config.pluginmanager.register(BudgetCheck(), "dual-sampling-budget")
    config.pluginmanager.register(processes.EngineStarts(), "dual-sampling-engine-starts")


def pytest_collection_modifyitems(items):
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)


def pytest_collection_finish(session):
    """With engine tests selected, this process's fork server (``dual_sampling.driver.engine_start``) starts now: its
    imports overlap collection, and it is in every test's snapshot of the processes before it starts engines, so it
    never counts as a leftover."""
    if any(item.get_closest_marker("engine") for item in session.items):
        from dual_sampling.driver import engine_start

        engine_start.warm()


@pytest.fixture(scope="session")
def tiny_same():
    return tiny_models.tiny_pair("same")


@pytest.fixture(scope="session")
def dual_engine(tiny_same):
    from dual_sampling import OptimalSamplingDual

    teacher, theta = tiny_same
    with OptimalSamplingDual(
        teacher, theta, max_num_seqs=4, max_model_len=256, sync_timeout=30, use_tqdm=False, max_dense_logprobs=16
    ) as s:
        yield s


@pytest.fixture(scope="session")
def hf_models(tiny_same):
    """The tiny (teacher, theta) pair in plain transformers: the independent re-scoring oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    teacher, theta = tiny_same
    return (
        AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval(),
        AutoModelForCausalLM.from_pretrained(theta, dtype=torch.float32).eval(),
    )
