"""A made-up penalty is one new module in ``dual_sampling/decision/stages/`` and nothing else.

The module below (a "recency penalty": λ off the logit of the sample's last token) is written into a copy of the
packages, untouched otherwise, and a fresh interpreter checks that every surface picks it up: its place among the
stages, its check (an error naming the field), the request options and the rows the engines receive (and their JSON
round trip), the draw's law (chi-square against a float64 recomputation, with a positive control), the kernels
sending its rows to the reference, the speculative mode's refusal by name, and the CLI's flag with its docstring.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.tolerances import ONE_NORMALISATION_ATOL

ROOT = Path(__file__).resolve().parent.parent

RECENCY_STAGE = '''
"""A made-up penalty for the plug-in test: λ off the logit of the token the sample generated last."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dual_sampling.checks import is_number, require
from dual_sampling.decision.stages.base import Stage, StageBatch


@dataclass(kw_only=True)
class RecencySettings:
    recency_penalty: float = 0.0
    """Subtracted from the mixture's logit of the token generated last (>= 0; 0 is off)."""


class Recency(Stage):
    order = 45
    settings = RecencySettings

    def check(self, options: Any) -> None:
        v = options.recency_penalty
        require(is_number(v) and v >= 0, f"recency_penalty must be a finite number >= 0, got {v!r}")

    def used(self, row: Any) -> bool:
        return row.recency_penalty > 0

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        for i, row in enumerate(batch.rows):
            if self.used(row) and batch.outputs[i]:
                x[i, batch.outputs[i][-1]] -= row.recency_penalty
'''

CHECKS = """
import dataclasses, json, subprocess, sys
import numpy as np, torch
import dual_sampling
from alpha import FixedAlpha
from dual_sampling.decision.fusable import kernel_rows
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from dual_sampling.decision.stages import STAGES
from dual_sampling.driver.requests import DualRequest
from dual_sampling.driver.speculative_driver import check_speculative
from dual_sampling.options import SamplingOptions
from tests.draws import _chi_square_p

out = {"package": dual_sampling.__file__, "stages": [s.name for s in STAGES]}
try:
    SamplingOptions(recency_penalty=-1.0)
except ValueError as exc:
    out["refused"] = str(exc)
opts = SamplingOptions(recency_penalty=2.5, max_tokens=16)
row = opts.row(7, masked_before_min_tokens=(0,))
out["round_trip"] = RowSampling.from_dict(json.loads(json.dumps(row.to_dict()))) == row
out["row_value"] = row.recency_penalty
plain_row = dataclasses.replace(row, recency_penalty=0.0)
out["kernel_takes"] = kernel_rows([row, plain_row], FixedAlpha(alpha=0.4), torch.device("cpu"))
try:
    check_speculative(DualRequest([5, 6, 7], [5, 6, 7], dataclasses.replace(row, seed=1), max_tokens=8))
except ValueError as exc:
    out["speculative"] = str(exc)

# The law: many seeds of one row, each draw's token counted, against the float64 recomputation.
V, draws, alpha, last = 12, 6000, 0.4, 3
g = torch.Generator().manual_seed(0)
teacher, theta = torch.randn(1, V, generator=g), torch.randn(1, V, generator=g)
rows = [dataclasses.replace(row, seed=s) for s in range(draws)]
d = decide(ModelRows.pair(teacher.expand(draws, V), theta.expand(draws, V)), [4] * draws, rows,
           FixedAlpha(alpha=alpha), outputs=[[1, 2, last]] * draws)
lt = torch.log_softmax(teacher.double(), -1)[0].numpy()
lth = torch.log_softmax(theta.double(), -1)[0].numpy()
z = (1 - alpha) * lth + alpha * lt
z[last] -= 2.5
q = np.exp(z - np.logaddexp.reduce(z))
plain = np.exp((1 - alpha) * lth + alpha * lt)
plain /= plain.sum()
counts = np.bincount(d.tokens.numpy(), minlength=V)
out["p_value"] = _chi_square_p(counts, draws * q)
out["control_p_value"] = _chi_square_p(counts, draws * plain)
tokens = d.tokens.numpy()
out["logq_error"] = float(np.abs(d.logq.double().numpy() - np.log(q[tokens])).max())
helptext = subprocess.run([sys.executable, "-m", "dual_sampling.cli", "generate", "--help"], capture_output=True,
                          text=True, check=True).stdout
out["help"] = " ".join(helptext.split())
print(json.dumps(out))
"""


def _copy_packages(target: Path) -> None:
    for name in ("alpha", "processors", "dual_sampling", "tests"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))


def test_a_new_stage_module_reaches_every_surface(tmp_path):
    _copy_packages(tmp_path)
    (tmp_path / "dual_sampling/decision/stages/recency.py").write_text(textwrap.dedent(RECENCY_STAGE))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", CHECKS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(tmp_path))  # the copy ran, not the installed tree
    assert out["stages"].index("Recency") == out["stages"].index("Penalties") + 1  # order 45: before Temperature
    assert "recency_penalty" in out["refused"]
    assert out["round_trip"] and out["row_value"] == 2.5
    assert out["kernel_takes"] == [False, True]  # no kernel implements it: the reference decides its rows
    assert "recency_penalty" in out["speculative"]
    assert out["p_value"] > 1e-3
    assert out["control_p_value"] < 1e-6  # the draws do see the penalty
    assert out["logq_error"] < ONE_NORMALISATION_ATOL  # the recorded log q is the penalised law's (float32, once)
    assert "--recency-penalty" in out["help"] and "the token generated last" in out["help"]
