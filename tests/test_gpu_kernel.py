"""The fused GPU decision (``dual_sampling.decision.gpu_kernel``), checked without a GPU and, where there is one, on it.

- Its cases against the float64 oracles (``tests/gpu_kernel_cases.py``) run under Triton's interpreter, in a pytest
  process of their own.
- Triton's own compiler builds the kernel for an H100 (sm_90), so that what the interpreter accepts is also what a
  GPU runs.
- Tests marked ``gpu`` run the compiled kernel on a CUDA device and skip without one; on a CUDA machine run them with
  ``pytest -m gpu tests/test_gpu_kernel.py`` (``make gpu-check`` runs only examples/bench_gpu.py and
  examples/bench_verify_gpu.py).

The law of the draw on masked rows (:func:`masked_draw_p_values`) is checked in both places: under the interpreter
on a small vocabulary, and on a GPU at a real one, where warps run at once and a block sum read before its masked
value was stored would bias the draw (the interpreter runs one program's operations in order and cannot show that).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.edits import RowEdits, row_edits
from dual_sampling.decision.kernel import decide_fused
from dual_sampling.decision.pipeline import ModelRows, RowSampling, counter_uniform
from tests.oracles import np_alpha_kl, np_log_softmax, np_mix
from tests.tolerances import ALPHA_TWO_SOLVES_ATOL, TWO_NORMALISATIONS_ATOL

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
CASES = 12
"""Test cases in tests/gpu_kernel_cases.py (parametrised ones counted once per parameter)."""
LEVEL = 1e-3
"""A chi-square p-value under this rejects the law (the draws are fixed by their seeds, so the test is too)."""


def masked_row(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(teacher ``[V]``, theta ``[V]`` float32 logits, masked ids) of related models (theta = 0.6·teacher + noise).

    The four masked ids (1 and 5, the middle token and the last: two share the first block, another block holds a
    third, the last block the fourth) each weigh 12% of the other tokens' mass in either model, so the mask takes
    about a third of q's (0.32 to 0.35 here, at the solved α and at α = 1).
    """
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(vocab, generator=g, dtype=torch.float64)
    theta = 0.6 * teacher + 0.8 * torch.randn(vocab, generator=g, dtype=torch.float64)
    masked = sorted({1, 5, vocab // 2, vocab - 1})
    others = torch.ones(vocab, dtype=torch.bool)
    others[masked] = False
    for logits in (teacher, theta):
        logits[masked] = torch.logsumexp(logits[others], 0) + np.log(0.12)
    return teacher.float(), theta.float(), masked


def chi_square_p(tokens: np.ndarray, q: np.ndarray) -> float:
    """Pearson's chi-square p-value of drawn ``tokens`` against the law ``q`` ``[V]``. Bins are runs of consecutive
    ids, each closed once it expects 5 draws (the last joins the one before): a draw biased between blocks of the
    vocabulary, as a stale block sum biases it, moves the counts of whole bins."""
    expected = q * len(tokens)
    bins = np.empty(len(q), dtype=np.int64)
    k, filled = 0, 0.0
    for i, e in enumerate(expected.tolist()):
        bins[i] = k
        filled += e
        if filled >= 5.0:
            k, filled = k + 1, 0.0
    if filled < 5.0 and k > 0:
        bins[bins == k] = k - 1
    bins_expected = np.bincount(bins, weights=expected)
    bins_observed = np.bincount(bins[tokens], minlength=len(bins_expected))
    stat = float(((bins_observed - bins_expected) ** 2 / bins_expected).sum())
    dof = len(bins_expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def masked_edits(masked: list, vocab: int) -> RowEdits | None:
    """The kernels' edits that mask each row's ``masked`` ids (as stop tokens before min_tokens, at step 0)."""
    rows = [RowSampling(min_tokens=1, stop_token_ids=tuple(m)) for m in masked]
    return row_edits(rows, [0] * len(rows), None, vocab, None)


def masked_draw_p_values(
    decide_gpu, device: str, vocab: int, draws: int, forced: bool, **blocks
) -> tuple[np.ndarray, float, float]:
    """Draw one masked row (:func:`masked_row`) ``draws`` times, seeds 0…draws−1, with kl_symmetry (α = 1 where
    ``forced``): (the kernel's ``[draws, 8]`` result, the chi-square p-value against float64 q at the oracle's α with
    the masked ids removed, and the same against q with them kept: the positive control, which must reject).

    The row is one ``[V]`` tensor expanded to ``[draws, V]`` (stride 0), so a large vocabulary costs no memory; each
    program still has its own block sums. ``blocks`` goes to ``decide_gpu`` (``block=``, for the interpreter).
    """
    teacher, theta, masked = masked_row(vocab, seed=0)
    lt, lth = np_log_softmax(teacher.double().numpy()), np_log_softmax(theta.double().numpy())
    alpha = 1.0 if forced else np_alpha_kl(lth, lt)  # α is solved on the whole vocabulary, then the mask applies
    uniforms = [counter_uniform(seed, 0) for seed in range(draws)]
    out = decide_gpu(
        ModelRows.pair(teacher.to(device).expand(draws, vocab), theta.to(device).expand(draws, vocab)),
        uniforms,
        [forced] * draws,
        get_alpha_computer("kl_symmetry"),
        None,
        edits=masked_edits([masked] * draws, vocab),
        **blocks,
    )
    out = out.cpu().numpy()
    tokens = out[:, 0].astype(np.int64)
    without = lth.copy()
    without[masked] = -np.inf
    return out, chi_square_p(tokens, np_mix(without, lt, alpha)), chi_square_p(tokens, np_mix(lth, lt, alpha))


INTERPRETED_HALVES = ("masked_rows or block_boundary or decide", "not (masked_rows or block_boundary or decide)")
"""The cases split in two of about equal time, run at once: the interpreter runs on one core."""


def test_the_kernel_against_float64_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu_kernel_cases.py", "-k", half],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in INTERPRETED_HALVES
    ]
    passed = 0
    for run in runs:
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stdout[-6000:] + stderr[-2000:]
        counts = re.search(r"(\d+) passed", stdout)
        assert counts and " failed" not in stdout, stdout[-2000:]
        passed += int(counts[1])
    assert passed == CASES


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
                 "penalty_ptr": "*fp64", "edits_ptr": "*fp64", "n_edits": "i32", "blocks_ptr": "*fp32",
                 "n_blocks": "i32",
                 "out_ptr": "*fp64"}
        barriers = []
        for method, normalized in ((0, True), (1, False)):  # each branch of both compile-time switches
            constants = {"METHOD": method, "THETA_NORMALIZED": normalized, "BLOCK": gpu_kernel.BLOCK,
                         "BLOCK_SCAN": 256, "MAX_PASSES": 200, "TINY": 1e-30}
            source = ASTSource(gpu_kernel._decide_rows, {**kinds, **{k: "constexpr" for k in constants}},
                               constexprs=constants)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": gpu_kernel.NUM_WARPS})
            assert len(compiled.asm["cubin"]) > 10000
            # tl.debug_barrier() after each edit's store and before the draw: the only barriers in Triton's IR
            # (reductions add theirs later).
            barriers.append(sum("barrier" in line for line in compiled.asm["ttir"].splitlines()))
        assert barriers == [2, 2], barriers
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
    assert all(figures[f"decision_{g}_ms"] > 0 for g in (2, 4, 8))  # verify_drafts, as the mode runs it
    assert all(0 < r["speculative_work_used"] <= 1 for r in report["layouts"])
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
    max_d = (torch.log_softmax(teacher.double(), -1) - torch.log_softmax(theta.double(), -1)).abs().amax(-1).numpy()
    for computer in (get_alpha_computer("kl_symmetry"), get_alpha_computer("fixed", alpha=0.4)):
        out = (
            gk.decide_gpu(ModelRows.pair(teacher.cuda(), theta.cuda()), uniforms, [False] * 64, computer, None)
            .cpu()
            .numpy()
        )
        cpu, _ = decide_fused(ModelRows.pair(teacher, theta), uniforms, [False] * 64, computer, None)
        assert (out[:, 5] == 0).all()
        assert (out[:, 0] == cpu[:, 0]).mean() >= 63 / 64  # a draw at a CDF boundary may round either way
        np.testing.assert_allclose(out[:, 1], cpu[:, 1], atol=ALPHA_TWO_SOLVES_ATOL, rtol=0)  # two float32 solves
        # The records of the rows that drew the same token: two kernels' normalisations, each blocked (ONE at any V);
        # log q besides moves between the two α by |Δα|·|d(y) − E_q[d]| ≤ |Δα|·2·max |d|.
        same = out[:, 0] == cpu[:, 0]
        np.testing.assert_allclose(out[same, 2:4], cpu[same, 2:4], atol=TWO_NORMALISATIONS_ATOL, rtol=0)
        moved = (np.abs(out[:, 1] - cpu[:, 1]) * 2 * max_d)[same].max()
        np.testing.assert_allclose(out[same, 4], cpu[same, 4], atol=TWO_NORMALISATIONS_ATOL + moved, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("forced", [False, True], ids=["masked", "forced-and-masked"])
def test_on_a_gpu_masked_rows_draw_q_without_the_masked_tokens(forced):
    """16,384 draws of a 151,936-token row with masked ids: the law is q without them (a masked block's sum read by
    another warp before its store would move draws between blocks), and the positive control rejects."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import dual_sampling.decision.gpu_kernel as gk

    out, p_masked, p_unmasked = masked_draw_p_values(gk.decide_gpu, "cuda", 151_936, 16_384, forced)
    assert (out[:, 5] == 0).all()
    assert p_masked > LEVEL, p_masked
    assert p_unmasked < LEVEL, p_unmasked
