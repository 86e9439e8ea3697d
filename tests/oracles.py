"""Independent oracles for the engine tests: teacher-forced re-scoring in plain transformers, and q in float64."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import torch

from tests.tolerances import LOGQ_ATOL_FACTOR, RESCORE_ATOL

# ---------------------------------------------------------------- α in float64 NumPy, by plain bisection


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x[np.isfinite(x)])
    return x - (m + np.log(np.sum(np.exp(x - m))))


def np_mix(lth: np.ndarray, lt: np.ndarray, a: float) -> np.ndarray:
    """Normalised q_a on the joint support (probabilities, float64)."""
    joint = np.isfinite(lth) & np.isfinite(lt)
    x = np.full_like(lth, -np.inf)
    x[joint] = (1 - a) * lth[joint] + a * lt[joint]
    return np.exp(np_log_softmax(x))


def np_kl(p: np.ndarray, logr: np.ndarray) -> float:
    m = p > 0
    return float(np.sum(p[m] * (np.log(p[m]) - logr[m])))


def _joint_rows(lth: np.ndarray, lt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log π_θ on the joint support, −inf elsewhere; d = log π_t − log π_θ there, 0 elsewhere)."""
    joint = np.isfinite(lth) & np.isfinite(lt)
    with np.errstate(invalid="ignore"):
        return np.where(joint, lth, -np.inf), np.where(joint, lt - lth, 0.0)


def _tilted(base: np.ndarray, d: np.ndarray, a: float) -> tuple[float, float]:
    """(E_{q_a}[d], log Σ exp(base + a·d)) in float64: q_a's mean of d and its log-normaliser."""
    x = base + a * d
    top = np.max(x)
    w = np.exp(x - top)
    total = np.sum(w)
    return float(np.dot(w.ravel(), d.ravel()) / total), float(top + np.log(total))


def np_kl_residual(lth, lt, a) -> float:
    """KL(q‖π_θ) − KL(q‖π_t) at a, which is Σ q·(log π_t − log π_θ) = E_q[d] (the log q terms cancel)."""
    return _tilted(*_joint_rows(lth, lt), a)[0]


def np_ess_log_ratio(lth, lt, a) -> float:
    """log(Σ π_t²/q / Σ π_θ²/q) at a, over the support of q."""
    q = np_mix(lth, lt, a)
    m = q > 0
    return float(np.log(np.sum(np.exp(2 * lt[m]) / q[m])) - np.log(np.sum(np.exp(2 * lth[m]) / q[m])))


def np_bisect(f, lo=0.0, hi=1.0, iters=200) -> float:
    """Root of an increasing f on [lo, hi], clamped to the ends."""
    if f(lo) >= 0:
        return lo
    if f(hi) <= 0:
        return hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:  # the interval is down to adjacent floats: more halvings change nothing
            break
        if f(mid) > 0:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)


def np_alpha_kl(lth, lt) -> float:
    base, d = _joint_rows(lth, lt)  # once per row: each bisection step is then one pass over the vocabulary
    return np_bisect(lambda a: _tilted(base, d, a)[0])


def np_alpha_ess(lth, lt) -> float:
    return np_bisect(lambda a: -np_ess_log_ratio(lth, lt, a))


def np_alpha_entropy(lth, lt) -> float:
    """entropy's closed form, H(π_t) / (H(π_θ) + H(π_t)), 0.5 when both are one-hot."""
    h = lambda logp: float(-np.sum(np.where(np.isfinite(logp), np.exp(logp) * logp, 0.0)))
    total = h(lth) + h(lt)
    return h(lt) / total if total > 0 else 0.5


def np_alpha_trust_region(lth, lt, budget: float, lo: float = 0.0, hi: float = 1.0, iters: int = 200) -> float:
    """The largest a in [lo, hi] with KL(q_a‖π_θ) ≤ budget, by bisection on that predicate (lo if even lo exceeds
    it): the boundary of the set the predicate holds on, never a root picked inside a flat stretch."""
    base, d = _joint_rows(lth, lt)

    def within(a: float) -> bool:
        # log q_a − log π_θ = a·d − log Σ exp(base + a·d) on the support, so KL(q_a‖π_θ) = a·E_q[d] − that log-sum.
        mean, log_total = _tilted(base, d, a)
        return a * mean - log_total <= budget

    if within(hi):
        return hi
    if not within(lo):
        return lo
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


BISECTION_ORACLES = {"kl_symmetry": np_alpha_kl, "ess_balance": np_alpha_ess}
"""The methods whose α the float64 bisection solves independently of the alpha package."""
FLOAT64_ORACLES = {**BISECTION_ORACLES, "entropy": np_alpha_entropy, "fixed": None}
"""Every built-in method's α in float64 NumPy, none through the alpha package (fixed: its configured constant)."""


def rescore(model, prompt_ids: list[int], token_ids: list[int], vocab: int) -> torch.Tensor:
    """Teacher-forced log-softmax rows [T, vocab] predicting each generated token, in plain transformers."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(token_ids), :vocab]
    return torch.log_softmax(logits.double(), -1)


def _keep_top(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Tokens in the top-k and in the smallest set whose mass reaches top_p (the best token always stays)."""
    order = torch.argsort(logp, descending=True)
    probs = torch.softmax(logp[order], -1)
    keep_sorted = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep_sorted[top_k:] = False
    if top_p < 1:
        keep_sorted &= (torch.cumsum(probs, -1) - probs) < top_p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def reference_logq(
    lth: torch.Tensor,
    lt: torch.Tensor,
    alpha: torch.Tensor,
    step0: int = 0,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    min_tokens: int = 0,
    stop_ids: tuple = (),
    logit_bias: dict | None = None,
    teacher_support_top_k: int = -1,
    teacher_support_top_p: float = 1.0,
    force_first_token: bool = False,
) -> torch.Tensor:
    """log q [T, V] in float64, stage by stage, written independently of dual_sampling.decision.pipeline."""
    out = []
    for t in range(lth.shape[0]):
        a = 1.0 if force_first_token and step0 + t == 0 else float(alpha[t])
        x = (1 - a) * lth[t] + a * lt[t]
        if teacher_support_top_k > 0 or teacher_support_top_p < 1:
            x = torch.where(_keep_top(lt[t], teacher_support_top_k, teacher_support_top_p), x, -math.inf)
        if step0 + t < min_tokens:
            x[list(stop_ids)] = -math.inf
        for token, bias in (logit_bias or {}).items():
            x[token] += bias
        x = x / temperature
        if top_k > 0 or top_p < 1:
            x = torch.where(_keep_top(torch.log_softmax(x, -1), top_k, top_p), x, -math.inf)
        if min_p > 0:
            p = torch.softmax(x, -1)
            x = torch.where(p >= min_p * p.max(), x, -math.inf)
        out.append(torch.log_softmax(x, -1))
    return torch.stack(out)


def oracle_alpha(
    lth: torch.Tensor, lt: torch.Tensor, alpha_method: str = "kl_symmetry", **alpha_config
) -> torch.Tensor:
    """α [T] of re-scored rows ``lth``, ``lt`` [T, V] (log-probabilities, float64) from :data:`FLOAT64_ORACLES`,
    independent of the alpha package (``alpha_config``: fixed's ``alpha``, trust_region's ``kl_budget``); not
    clamped, so engines run with the default bounds [0, 1]."""
    if alpha_method == "fixed":
        return torch.full((len(lth),), float(alpha_config.get("alpha", 0.5)), dtype=torch.float64)
    if alpha_method == "trust_region":
        budget = alpha_config["kl_budget"]
        solve = lambda h, t: np_alpha_trust_region(h, t, budget)
    else:
        solve = FLOAT64_ORACLES[alpha_method]
    return torch.tensor([solve(h.numpy(), t.numpy()) for h, t in zip(lth, lt)], dtype=torch.float64)


def oracle_rows(sample, request, hf_teacher, hf_theta, vocab: int, alpha_method: str = "kl_symmetry", **alpha_config):
    """(log π_t, log π_θ, α) of every generated token by teacher-forced re-scoring, in float64 (α:
    :func:`oracle_alpha`). ``hf_theta`` may map θ versions to models: each token's row is then re-scored by the model
    of the version the sample names for it (``theta_versions``, else ``theta_version`` for all)."""
    lt = rescore(hf_teacher, request.teacher_prompt_token_ids, sample.token_ids, vocab)
    if isinstance(hf_theta, dict):
        versions = sample.theta_versions or [sample.theta_version] * len(sample.token_ids)
        rows = {v: rescore(hf_theta[v], request.theta_prompt_token_ids, sample.token_ids, vocab) for v in set(versions)}
        lth = torch.stack([rows[v][t] for t, v in enumerate(versions)])
    else:
        lth = rescore(hf_theta, request.theta_prompt_token_ids, sample.token_ids, vocab)
    return lt, lth, oracle_alpha(lth, lt, alpha_method, **alpha_config)


def assert_kl_symmetry_alpha(
    recorded: torch.Tensor, root: torch.Tensor, lth: torch.Tensor, lt: torch.Tensor, atol, residual_atol
):
    """kl_symmetry's α [T] against the float64 bisection's root, allowing for the engines' own logits.

    The engines' logits differ from plain transformers' by float32 rounding (about 1e-5 nats). That moves the root
    of E_q[d] = 0 (d = log π_t − log π_θ) by about that difference / Var_q(d), which exceeds ``atol`` where the two
    models nearly agree (small Var_q(d)). So an α off by more than ``atol`` passes only if it still solves the
    oracle's equation, |E_q[d]| ≤ ``residual_atol`` nats at the recorded α (the caller's log π tolerance / 10: ten
    times those logit differences), and lies no further from the root than that residual allows to first order,
    ``residual_atol`` / Var_q(d) (twice, for the curvature). A wrong α (another method, a missed Newton step) leaves
    a residual far above that.
    """
    off = (recorded - root).abs()
    far = off > atol
    if not far.any():
        return
    d = (lt - lth)[far]
    q = torch.softmax(lth[far] + recorded[far].unsqueeze(-1) * d, -1)
    residual = (q * d).sum(-1)
    variance = (q * d * d).sum(-1) - residual**2
    allowed = atol + 2 * residual_atol / variance.clamp_min(1e-12)
    assert (residual.abs() <= residual_atol).all() and (off[far] <= allowed).all(), (
        f"alpha off the oracle's root by {(recorded - root)[far].tolist()} at steps {far.nonzero().flatten().tolist()}"
        f"; residual E_q[d] {residual.tolist()} (allowed {residual_atol}), Var_q(d) {variance.tolist()}"
    )


def assert_trust_region_alpha(recorded: torch.Tensor, boundary: torch.Tensor, lth, lt, budget: float, atol) -> None:
    """trust_region's α [T] against the float64 bisection's boundary, judged in KL where they differ.

    K(α) = KL(q_α‖π_θ) is flat near α = 0 (K ≈ α²·Var/2), so the engines' float32 logits (about 1e-5 nats off plain
    transformers') can move the boundary by far more than ``atol`` in α while K hardly moves. An α off by more than
    ``atol`` passes only if, under the oracle's rows, K(α) is within the budget and (unless α = 1) no more than
    10·``atol`` nats below it: a wrong α (another method, a budget not applied) misses that by a wide margin.
    """
    far = (recorded - boundary).abs() > atol
    for step in far.nonzero().flatten().tolist():
        a = recorded[step].item()
        kl = np_kl(np_mix(lth[step].numpy(), lt[step].numpy(), a), lth[step].numpy())
        assert kl <= budget + 10 * atol and (a >= 1.0 - atol or kl >= budget - 10 * atol), (
            f"step {step}: alpha {a} (oracle {boundary[step].item()}) gives KL(q‖π_θ) = {kl}, budget {budget}"
        )


def assert_records_match_rescoring(
    request,
    hf_teacher,
    hf_theta,
    vocab: int,
    alpha_method: str,
    atol: float = RESCORE_ATOL,
    alpha_config=None,
    worst: dict[str, float] | None = None,
    alpha_atol: float | None = None,
    **sampling,
) -> int:
    """Check every sample of ``request`` against the oracle (``sampling``: the options used); return tokens checked.

    ``atol`` bounds log π (nats; log q twice that) and, unless ``alpha_atol`` is given, α; where a model runs in
    bfloat16, α has its own bound (``tests.tolerances.BF16_ALPHA_ATOL``) and its residual check keeps ``atol`` / 10.

    ``worst``, if given, is raised to the largest |recorded − oracle| of each record (alpha, logp_teacher,
    logp_theta, logq; nats, α unitless) before the checks run, so a failing check still reports its figure."""
    checked = 0
    for sample in request.samples:
        assert sample.error is None, sample.error
        lt, lth, alpha = oracle_rows(sample, request, hf_teacher, hf_theta, vocab, alpha_method, **(alpha_config or {}))
        if sampling.get("force_first_token"):
            alpha = alpha.clone()
            alpha[0] = 1.0
        tok = torch.tensor(sample.token_ids).unsqueeze(-1)
        recorded_alpha = torch.tensor(sample.alpha, dtype=torch.float64)
        # q at the recorded α: the α check below is separate, so an α inside its tolerance is not counted twice.
        logq = reference_logq(lth, lt, recorded_alpha, **sampling).gather(-1, tok).squeeze(-1)
        if worst is not None:
            expected = {
                "alpha": alpha,
                "logp_teacher": lt.gather(-1, tok).squeeze(-1),
                "logp_theta": lth.gather(-1, tok).squeeze(-1),
                "logq": logq,
            }
            for name, value in expected.items():
                off = (torch.tensor(getattr(sample, name), dtype=torch.float64) - value).abs().max().item()
                worst[name] = max(worst.get(name, 0.0), off)
        # A forced first step has α = 1 exactly; the conditioning allowance below is for solved steps only.
        forced = 1 if sampling.get("force_first_token") else 0
        a_tol = atol if alpha_atol is None else alpha_atol
        torch.testing.assert_close(recorded_alpha[:forced], alpha[:forced], atol=a_tol, rtol=0)
        if alpha_method == "kl_symmetry":
            assert_kl_symmetry_alpha(
                recorded_alpha[forced:], alpha[forced:], lth[forced:], lt[forced:], a_tol, residual_atol=atol / 10
            )
        elif alpha_method == "trust_region":
            assert_trust_region_alpha(recorded_alpha, alpha, lth, lt, alpha_config["kl_budget"], a_tol)
        else:
            torch.testing.assert_close(recorded_alpha, alpha, atol=a_tol, rtol=0)
        assert torch.isfinite(logq).all(), "a sampled token lies outside the support the options allow"
        torch.testing.assert_close(
            torch.tensor(sample.logp_teacher, dtype=torch.float64), lt.gather(-1, tok).squeeze(-1), atol=atol, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(sample.logp_theta, dtype=torch.float64), lth.gather(-1, tok).squeeze(-1), atol=atol, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(sample.logq, dtype=torch.float64), logq, atol=atol * LOGQ_ATOL_FACTOR, rtol=0
        )
        checked += len(sample.token_ids)
    return checked


def assert_dense_match_rescoring(request, hf_teacher, hf_theta, vocab: int, k: int, atol=RESCORE_ATOL) -> float:
    """Every sample's dense top-k payload against re-scoring; return the largest |recorded − oracle| (nats).

    For each model (role 0 the teacher, 1 theta): the k ids are that model's own most likely tokens, untempered and
    unfiltered, with its log-probabilities there in descending order, and the other model's at the same ids. Where
    the sampled token is among them, its dense value and its record are one number.
    """
    largest = 0.0
    for s in request.samples:
        assert s.dense_ids.shape == s.dense_logp.shape == s.dense_other_logp.shape == (len(s.token_ids), 2, k)
        assert s.dense_ids.dtype == np.int32 and np.isfinite(s.dense_logp).all()
        assert np.isfinite(s.dense_other_logp).all()
        rescored = [
            rescore(model, prompt, s.token_ids, vocab)
            for model, prompt in (
                (hf_teacher, request.teacher_prompt_token_ids),
                (hf_theta, request.theta_prompt_token_ids),
            )
        ]
        for role, rows in enumerate(rescored):
            ids = torch.from_numpy(s.dense_ids[:, role].astype(np.int64))
            got = torch.from_numpy(s.dense_logp[:, role]).double()
            other = torch.from_numpy(s.dense_other_logp[:, role]).double()
            largest = max(
                largest,
                (got - rows.gather(1, ids)).abs().max().item(),
                (other - rescored[1 - role].gather(1, ids)).abs().max().item(),
            )
            assert torch.allclose(got, rows.gather(1, ids), atol=atol, rtol=0)
            kth = rows.topk(k, dim=-1).values[:, -1]
            # No token outside the set is more likely than its least likely (ties at float32 resolution aside); one
            # normaliser per row, so the values order exactly as the engine's logits do.
            assert (got[:, -1] >= kth - 2 * atol).all() and (got[:, :-1] >= got[:, 1:]).all()
            assert torch.allclose(other, rescored[1 - role].gather(1, ids), atol=atol, rtol=0)
        for t, token in enumerate(s.token_ids):
            for role, record in enumerate((s.logp_teacher, s.logp_theta)):
                hit = np.flatnonzero(s.dense_ids[t, role] == token)
                if hit.size:
                    assert s.dense_logp[t, role, hit[0]] == np.float32(record[t])
    return largest


def assert_written_records_match_rescoring(
    records, tokenizer, hf_teacher, hf_theta, vocab: int, atol=RESCORE_ATOL
) -> int:
    """Every data-run record (a dict per row) against re-scoring its own tokens; return the tokens checked.

    The prompts are tokenized from the record's text as the engine tokenizes text prompts (with special tokens); then
    each record goes through :func:`assert_records_match_rescoring` (kl_symmetry, at the recorded temperature). This
    holds for any batch composition, where comparing the drawn tokens of two runs would not (docs/reliability.md, "Not
    guaranteed").
    """
    checked = 0
    for r in records:
        ids = {
            side: tokenizer(r[f"{side}_prompt"], add_special_tokens=True)["input_ids"] for side in ("teacher", "theta")
        }
        sample = SimpleNamespace(
            **{k: r[k] for k in ("error", "token_ids", "alpha", "logp_teacher", "logp_theta", "logq")}
        )
        request = SimpleNamespace(
            teacher_prompt_token_ids=ids["teacher"], theta_prompt_token_ids=ids["theta"], samples=[sample]
        )
        sampling = json.loads(r["sampling"]) if isinstance(r["sampling"], str) else r["sampling"]  # a string in Parquet
        checked += assert_records_match_rescoring(
            request, hf_teacher, hf_theta, vocab, "kl_symmetry", atol, temperature=sampling["temperature"]
        )
    return checked


def rows_sent_to_the_reference(monkeypatch) -> list[int]:
    """Spy on ``decide()``'s torch reference: the returned list gets the row count of every batch it is given."""
    from dual_sampling.decision import pipeline

    counts: list[int] = []
    reference = pipeline._decide_reference

    def recorded(models, *args, **kwargs):
        counts.append(len(models))
        return reference(models, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_decide_reference", recorded)
    return counts
