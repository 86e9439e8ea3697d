"""Shared fixtures: real vLLM CPU engines on the tiny models, started once per session."""

from __future__ import annotations

import pytest

from dual_sampling import models


@pytest.fixture(scope="session")
def tiny_same():
    return models.tiny_pair("same")


@pytest.fixture(scope="session")
def dual_engine(tiny_same):
    from dual_sampling import OptimalSamplingDual

    teacher, theta = tiny_same
    with OptimalSamplingDual(teacher, theta, max_num_seqs=4, max_model_len=256, sync_timeout=30, use_tqdm=False) as s:
        yield s


@pytest.fixture(scope="session")
def hf_models(tiny_same):
    """The tiny (teacher, theta) pair in plain transformers: the independent re-scoring oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    teacher, theta = tiny_same
    return (AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval(),
            AutoModelForCausalLM.from_pretrained(theta, dtype=torch.float32).eval())
