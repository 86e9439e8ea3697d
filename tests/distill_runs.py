"""A short distillation run on the tiny pair: its prompts file and its settings (tests/test_distill.py, and the
speculative mode's run in tests/test_speculative_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dual_sampling.options import EngineOptions
from dual_sampling.run_settings import ModelsAndPrompts

WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "window", "music", "paper", "light", "orange", "winter"]


def write_prompts(path: Path) -> Path:
    """40 rows of six random words under ``question`` (the last ``eval_prompts`` are held out)."""
    rng = np.random.default_rng(3)
    rows = [{"question": " ".join(rng.choice(WORDS, 6)), "answer": "x"} for _ in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def small_run(tiny_same, prompts_file, tmp_path, **overrides) -> dict:
    """The settings of a short run on the tiny pair (the session's dual_engine serves it); ``overrides`` win."""
    teacher, theta = tiny_same
    return {
        "prompts": str(prompts_file),
        "output": str(tmp_path / "run"),
        "source": ModelsAndPrompts(str(teacher), str(theta), prompt_field="question", chat_template=False),
        "eval_prompts": 4,
        "loss_top_k": 16,
        "engine": EngineOptions(max_dense_logprobs=16),
        **overrides,
    }
