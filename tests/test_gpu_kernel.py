"""The fused GPU decision (``dual_sampling.decision.gpu_kernel``), checked without a GPU and, where there is one, on it.

- Its cases against the float64 oracles (``tests/gpu_kernel_cases.py``) run under Triton's interpreter, in a pytest
  process of their own.
- Triton's own compiler builds the kernel for an H100 (sm_90), so that what the interpreter accepts is also what a
  GPU runs.
- Tests marked ``gpu`` run the compiled kernel on a CUDA device and skip without one (``make gpu-check``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.kernel import decide_fused
from dual_sampling.decision.pipeline import counter_uniform

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
CASES = 6
"""Test cases in tests/gpu_kernel_cases.py (parametrised ones counted once per parameter)."""


def test_the_kernel_against_float64_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu_kernel_cases.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"{CASES} passed" in done.stdout, done.stdout[-2000:]


def test_the_kernel_compiles_for_an_h100():
    """Triton's compiler, to sm_90 machine code (no GPU needed): what the interpreter ran is what a GPU can run."""
    pytest.importorskip("triton.backends.nvidia")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from dual_sampling.decision import gpu_kernel
        kinds = {"teacher_ptr": "*fp32", "theta_ptr": "*fp32", "row_stride_t": "i64", "row_stride_h": "i64",
                 "V": "i32", "params_ptr": "*fp64", "alpha0_ptr": "*fp64", "force_ptr": "*fp64", "u_ptr": "*fp64",
                 "masked_ptr": "*fp64", "n_masked": "i32", "blocks_ptr": "*fp32", "n_blocks": "i32",
                 "out_ptr": "*fp64"}
        for method, normalized in ((0, True), (1, False)):  # each branch of both compile-time switches
            constants = {"METHOD": method, "THETA_NORMALIZED": normalized, "BLOCK": gpu_kernel.BLOCK,
                         "BLOCK_SCAN": 256, "MAX_PASSES": 200, "TINY": 1e-30}
            source = ASTSource(gpu_kernel._decide_rows, {**kinds, **{k: "constexpr" for k in constants}},
                               constexprs=constants)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": gpu_kernel.NUM_WARPS})
            assert len(compiled.asm["cubin"]) > 10000
        print("COMPILED")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "COMPILED" in done.stdout, done.stderr[-3000:]


def test_the_gpu_check_script_runs_end_to_end_on_the_cpu(tmp_path):
    """``make gpu-check``'s script with --smoke: its checks and its figures, on the CPU under the interpreter."""
    out = tmp_path / "gpu-check.json"
    done = subprocess.run(
        [sys.executable, "examples/bench_gpu.py", "--smoke", "--output", str(out)],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks_passed"] and report["checks"]["kernel"]["kl_symmetry"]["same_tokens"] == 1.0
    (row,) = report["results"]
    assert row["decide_kl_symmetry_ms"] > 0 and row["transport"]["host_ms"] > 0
    assert "decide kl_symmetry" in out.with_suffix(".md").read_text()


def test_the_verification_benchmark_runs_on_the_cpu_and_models_rounds_as_the_rule_emits_them(tmp_path):
    """``make gpu-check``'s second script with --smoke (tiny shapes on the CPU), and its tokens per round against
    a simulation of the rule's round lengths (no bonus token after γ accepted drafts)."""
    out = tmp_path / "verify.json"
    done = subprocess.run(
        [sys.executable, "examples/bench_verify_gpu.py", "--smoke", "--output", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    (figures,) = report["figures"].values()
    assert all(figures[k] > 0 for k in ("teacher_decode_ms", "teacher_verify_4_ms", "theta_decode_ms"))
    assert {r["acceptance"] for r in report["layouts"]} == {0.61, 0.78}
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from bench_verify_gpu import tokens_per_round
    finally:
        sys.path.remove(str(ROOT / "examples"))
    rng = np.random.default_rng(0)
    for beta, gamma in ((0.61, 4), (0.9, 8)):
        kept = rng.random((200_000, gamma)) < beta
        first_rejection = np.where(kept.all(1), gamma, kept.argmin(1))  # drafts kept before the first rejection
        emitted = np.minimum(first_rejection + 1, gamma)  # + the residual draw, none after γ kept
        assert abs(emitted.mean() - tokens_per_round(beta, gamma)) < 0.01


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_draws_what_the_cpu_kernel_draws():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import dual_sampling.decision.gpu_kernel as gk

    g = torch.Generator().manual_seed(5)
    teacher, theta = 3.0 * torch.randn(64, 151_936, generator=g), 1.5 * torch.randn(64, 151_936, generator=g)
    uniforms = [counter_uniform(11, s) for s in range(64)]
    for computer in (get_alpha_computer("kl_symmetry"), get_alpha_computer("fixed", alpha=0.4)):
        out = (
            gk.decide_gpu(
                teacher.cuda(),
                theta.cuda(),
                uniforms,
                [False] * 64,
                computer,
                None,
            )
            .cpu()
            .numpy()
        )
        cpu, _ = decide_fused(teacher, theta, uniforms, [False] * 64, computer, None)
        assert (out[:, 5] == 0).all()
        assert (out[:, 0] == cpu[:, 0]).mean() >= 63 / 64  # a draw at a CDF boundary may round either way
        np.testing.assert_allclose(out[:, 1:5], cpu[:, 1:5], atol=1e-4)
