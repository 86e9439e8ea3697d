"""From the models' logits to one token: the decision made once per token.

The models' rows arrive as one :class:`~dual_sampling.decision.rows.ModelRows` (the roster names them). Order of
operations (per row; α is the teacher weight, one per teacher with several):

1. log π_θ and log π_t: log-softmax of each model's untempered logits over the shared tokenizer's vocabulary.
2. α from the alpha computer, on those untempered distributions, clamped to [alpha_min, alpha_max]; α = 1 at step 0
   when ``force_first_token`` is set (several teachers: θ's weight 0, the teachers' in their proportions).
3. log q = geometric_mix(log π_θ, log π_t, α) (several: ∝ π_θ^(1−Σα)·Π π_i^α_i), unnormalised until the draw.
4–10. The stages of :mod:`dual_sampling.decision.stages`, in this order:
   4. teacher support: tokens outside the teacher's top-k / top-p set are removed (refused with several teachers);
   5. min_tokens: the stop tokens are removed while fewer than min_tokens were generated;
   6. logit_bias is added (each value clamped to ±100, as vLLM does);
   7. the repetition, frequency and presence penalties act on the mixture's logits, as vLLM's on one model's;
   8. temperature divides log q (0 means greedy);
   9. top_k, top_p and min_p filter the tempered distribution;
   10. diversity: the tokens the earlier members of the row's group took at this step lose λ each time taken.
11. Renormalise and draw with a counter-based uniform of (seed, step): the same seed gives the same token whatever
   the batch or timing. The recorded log q is the drawn token's log-probability under this final law (0: greedy).

vLLM's own stages (min_tokens, logit_bias, penalties, bad words) are never handed to the
engines: a token forced after them could be masked to -inf. The supported ones run here.

:func:`decide` hands the rows that use no stage the kernels lack (``dual_sampling.decision.fusable``) to a fused
kernel, one pass per α evaluation and no V-sized temporaries: ``dual_sampling.decision.kernel`` on the CPU,
``dual_sampling.decision.gpu_kernel`` on CUDA devices (a decided batch then comes back to the host in one copy). The
torch code below stays the reference for every other row and device, and in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from alpha import AlphaComputer, geometric_log_weights, geometric_log_weights_teachers
from alpha.base import check_log_prob_pair, clamp_total
from alpha.mixing import theta_weight
from dual_sampling.decision.fusable import KernelColumn, kernel_device, kernel_rows
from dual_sampling.decision.result import Decision
from dual_sampling.decision.rows import ModelRows
from dual_sampling.decision.stages import STAGES, DecisionOptions, StageBatch, clamped_logit_bias, needs_logit_offset

__all__ = [
    "Decision",
    "ModelRows",
    "RowSampling",
    "check_stages_for_teachers",
    "counter_uniform",
    "decide",
    "draw_tokens",
    "inverse_cdf",
]

_MASK64 = (1 << 64) - 1


def counter_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) from (seed, step) alone (SplitMix64), reproducible across runs and batches."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


@dataclass(kw_only=True)
class RowSampling(DecisionOptions):
    """One sample's settings as the teacher processor receives them (plain data, picklable): the request's
    :class:`DecisionOptions` with the sample's own seed and stop tokens. Built by ``SamplingOptions.row``."""

    seed: int = 0
    """The sample's seed: its uniforms are ``counter_uniform(seed, step)``."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens masked while fewer than min_tokens were generated (EOS ids and the user's stop ids)."""
    prompt_token_ids: tuple[int, ...] = ()
    """Theta's prompt where a stage reads it (the repetition penalty counts the prompt's tokens), else empty."""
    group: int = 0
    """Where diversity_penalty is on: the id of the sample's group (the samples of one prompt in one call), else 0."""
    member: int = 0
    """The sample's place in its group: members ready at one step are decided in this order."""
    group_size: int = 1
    """Its group's members (the engine admits them together when they fit)."""

    def __post_init__(self) -> None:
        # Plain Python numbers of the declared kinds: the settings cross to the engines as JSON-like data.
        for f in fields(self):
            if f.type in ("int", "float", "bool"):
                setattr(self, f.name, {"int": int, "float": float, "bool": bool}[f.type](getattr(self, f.name)))
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.prompt_token_ids = tuple(int(t) for t in self.prompt_token_ids)
        self.logit_bias = clamped_logit_bias(self.logit_bias)  # rows also arrive from JSON, not only from options

    @property
    def diverse(self) -> bool:
        """Whether the sample is a member of a diverse group (a diversity penalty, and a group to apply it in)."""
        return self.diversity_penalty > 0 and self.group != 0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["prompt_token_ids"] = list(self.prompt_token_ids)
        d["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RowSampling:
        d = dict(d)
        d["stop_token_ids"] = tuple(d.get("stop_token_ids", ()))
        d["prompt_token_ids"] = tuple(d.get("prompt_token_ids", ()))
        d["logit_bias"] = {int(k): float(v) for k, v in (d.get("logit_bias") or {}).items()}
        return cls(**d)


_CDF_BLOCK = 256


def inverse_cdf(weights: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Draw by inversion from non-negative ``weights`` ``[b, V]`` (need not sum to 1), with ``u`` ``[b]`` in [0, 1).

    Returns (index ``[b]``, row totals ``[b]`` as float64): the index i has W(i−1) < u·total ≤ W(i),
    W being the cumulative sum. Two levels instead of one V-long cumulative sum: float64
    cumulative sums of 256-token block sums locate the block, then one block's cumulative sum
    locates the token. Nothing V-sized is copied.
    """
    _b, vocab = weights.shape
    full = vocab - vocab % _CDF_BLOCK
    # Block sums in the weights' own precision (a float64 sum would first copy all of them), then float64.
    sums = weights[:, :full].unflatten(-1, (-1, _CDF_BLOCK)).sum(-1)
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=-1)
    sums = sums.double()
    block_cdf = torch.cumsum(sums, dim=-1)
    total = block_cdf[:, -1]
    target = u.to(device=weights.device, dtype=torch.float64) * total
    block = torch.searchsorted(block_cdf, target.unsqueeze(-1)).squeeze(-1).clamp_max(block_cdf.shape[1] - 1)
    before = torch.where(
        block > 0, block_cdf.gather(-1, (block - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1), torch.zeros_like(target)
    )
    index = block.unsqueeze(-1) * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=weights.device)
    inner = weights.gather(-1, index.clamp_max(vocab - 1)).double().masked_fill_(index >= vocab, 0.0)
    inner_cdf = torch.cumsum(inner, dim=-1)
    pos = torch.searchsorted(inner_cdf, (target - before).unsqueeze(-1)).squeeze(-1).clamp_max(_CDF_BLOCK - 1)
    return (block * _CDF_BLOCK + pos).clamp_max(vocab - 1), total


class Draw(NamedTuple):
    """What :func:`draw_tokens` returns; every tensor has ``b`` rows."""

    tokens: Tensor
    """The drawn token of each row (int64)."""
    logq: Tensor
    """log-probability of the drawn token under the final distribution (0 for greedy rows)."""
    ok: Tensor
    """False where every token was removed (the row's token is 0 and must not be used)."""
    top: tuple[Tensor, Tensor] | None
    """(token ids ``[b, k]``, log-probabilities ``[b, k]``) of the final distribution's k most likely tokens,
    k = ``top_logprobs``; None when it is 0."""


def draw_tokens(
    logq: Tensor,
    logp_teacher: Tensor | None,
    steps: Sequence[int],
    rows: Sequence[RowSampling],
    overwrite: bool = False,
    top_logprobs: int = 0,
    outputs: Sequence[Sequence[int]] | None = None,
    logit_offset: Tensor | None = None,
    diversity: Sequence[dict[int, int]] | None = None,
) -> Draw:
    """Apply steps 4–10 above (the :data:`~dual_sampling.decision.stages.STAGES`, in their order) to ``logq``
    ``[b, V]`` and draw one token per row (step 11).

    ``logq`` is log q up to a per-row constant (it need not be normalised). With
    ``overwrite=True`` the stages work in ``logq`` itself, which saves a V-sized copy. ``outputs`` (each row's
    generated tokens) and ``logit_offset`` (``[b]``: log q + it is the mixture's logit) are the penalties' inputs,
    ``diversity`` (per row, the tokens its group's earlier members took at this step) the diversity's.
    Returns (tokens ``[b]`` int64, normalised log q of each drawn token ``[b]``, ok ``[b]``
    bool). A row whose every token was removed is not ok (its token is 0 and must not be
    used). Stages that are off cost nothing.
    """
    _b, vocab = logq.shape
    x = logq
    dev = x.device
    owned = overwrite

    def writable() -> Tensor:
        nonlocal x, owned
        if not owned:
            x, owned = x.clone(), True
        return x

    batch = StageBatch(logp_teacher, steps, rows, outputs, diversity, logit_offset)
    for stage in STAGES:
        if any(stage.used(r) for r in rows):
            stage.apply(writable(), batch)
    greedy = torch.tensor([r.temperature == 0 for r in rows], device=dev)
    top = x.amax(dim=-1)
    ok = top > -math.inf
    shift = torch.where(ok, top, torch.zeros_like(top))
    weights = (x - shift.unsqueeze(-1)).exp_()
    u = torch.tensor([counter_uniform(r.seed, s) for r, s in zip(rows, steps)], dtype=torch.float64, device=dev)
    sampled, total = inverse_cdf(weights, u)
    # Rounding can land on a zero-weight token at the edge of the CDF: step back to a kept one.
    dead = x.gather(-1, sampled.unsqueeze(-1)).squeeze(-1) == -math.inf
    if bool(dead.any()):
        sampled = torch.where(dead, x.argmax(-1), sampled)
    tokens = torch.where(greedy, x.argmax(dim=-1), sampled) if bool(greedy.any()) else sampled
    tokens = torch.where(ok, tokens, torch.zeros_like(tokens))
    log_norm = shift + torch.log(torch.where(ok, total, torch.ones_like(total))).to(x.dtype)
    logq_token = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    top = None
    if top_logprobs > 0:
        values, ids = x.topk(min(top_logprobs, vocab), dim=-1)
        top = (ids, values - log_norm.unsqueeze(-1))
    return Draw(tokens, torch.where(greedy | ~ok, torch.zeros_like(logq_token), logq_token), ok, top)


def decide(
    models: ModelRows,
    steps: Sequence[int],
    rows: Sequence[RowSampling],
    alpha_computer: AlphaComputer,
    alpha_init: Tensor | None = None,
    top_logprobs: int = 0,
    fused: bool = True,
    outputs: Sequence[Sequence[int]] | None = None,
    diversity: Sequence[dict[int, int]] | None = None,
) -> Decision:
    """Steps 1–11 of the module docstring for a batch of rows: the whole per-token decision.

    ``models`` holds each model's ``[b, V]`` rows over the shared vocabulary (:class:`ModelRows`; θ's may be
    normalised already, with their log-normalisers for the repetition penalty). ``alpha_init`` ``[b]`` (``[b, K]``
    with K teachers) warm-starts the α solve. ``top_logprobs`` > 0 also returns that many of the final
    distribution's most likely tokens for every row. ``outputs`` are each row's generated tokens (the penalties
    count them). ``diversity``: per row, the tokens the earlier members of its group took at this step, with their
    counts (the caller decides a group's members in order).

    With one teacher, rows that need no filter are decided by a fused kernel (numba's on the CPU, Triton's on CUDA
    devices), the rest by the torch reference; ``fused=False`` sends every row to the reference. The rows a kernel
    handed back, and those of them whose α solve did not converge, are flagged in ``handed_back`` and
    ``unconverged``. With several teachers every row takes the reference: q ∝ π_θ^(1−Σα)·Π π_i^α_i with one α per
    teacher (``AlphaComputer.compute_teachers``).
    """
    eligible = [False] * len(rows)
    if fused and top_logprobs == 0 and len(models.roster.teachers) == 1:
        eligible = kernel_rows(rows, alpha_computer, models.device)
    b = len(rows)
    if not any(eligible):
        result = _decide_reference(models, steps, rows, alpha_computer, alpha_init, top_logprobs, outputs, diversity)
        result.handed_back, result.unconverged = torch.zeros(b, dtype=torch.bool), torch.zeros(b, dtype=torch.bool)
        return result
    fast = [i for i, e in enumerate(eligible) if e]
    index = torch.tensor(fast)
    every = len(fast) == len(rows)  # then no V-sized copy of the inputs is made
    part = models if every else models.take(index)
    warm = alpha_init if alpha_init is None or every else alpha_init[index.to(alpha_init.device)]
    uniforms = [counter_uniform(rows[i].seed, steps[i]) for i in fast]
    forced = [rows[i].force_first_token and steps[i] == 0 for i in fast]
    # Imported here, not at module level: a vLLM CPU worker imports this module (through the processors) before it
    # scans every loaded module for Triton kernels, and that scan fails on an object of numba's LLVM binding.
    from dual_sampling.decision.edits import row_edits

    edits = row_edits(
        [rows[i] for i in fast],
        [steps[i] for i in fast],
        None if outputs is None else [outputs[i] for i in fast],
        models.vocab,
        _student_shift(models, fast),
        None if diversity is None else [diversity[i] for i in fast],
    )
    if kernel_device(models.device) == "cpu":
        from dual_sampling.decision.kernel import decide_fused

        out, _ = decide_fused(part, uniforms, forced, alpha_computer, warm, edits)
        decided = torch.from_numpy(out)
    else:
        from dual_sampling.decision.gpu_kernel import decide_gpu

        out = decide_gpu(part, uniforms, forced, alpha_computer, warm, edits)
        decided = out.cpu()  # the step's one wait on the device: the tokens and records go to the host anyway
    handed_back = [fast[k] for k in (decided[:, KernelColumn.STATUS] != 0).nonzero().flatten()]
    if handed_back:
        check_log_prob_pair(models.student, models.teacher)  # a bad row is named by its index in this batch
    slow = [i for i, e in enumerate(eligible) if not e] + handed_back
    result = Decision(
        torch.zeros(b, dtype=torch.int64),
        torch.zeros(b),
        torch.zeros(b, len(models.logits)),
        torch.zeros(b),
        torch.ones(b, dtype=torch.bool),
        handed_back=torch.zeros(b, dtype=torch.bool),
        unconverged=torch.zeros(b, dtype=torch.bool),
    )
    result.handed_back[handed_back] = True
    # Both kernels flag an unconverged solve (and hand the row back with status 1).
    result.unconverged[index] = decided[:, KernelColumn.UNCONVERGED] != 0
    for name, column in (("tokens", KernelColumn.TOKEN), ("alpha", KernelColumn.ALPHA), ("logq", KernelColumn.LOGQ)):
        getattr(result, name)[index] = decided[:, column].to(getattr(result, name).dtype)
    positions = torch.tensor([models.teacher_positions[0], models.student_position])  # the kernels' log π columns
    result.logp[index.unsqueeze(-1), positions] = decided[
        :, [KernelColumn.LOGP_TEACHER, KernelColumn.LOGP_STUDENT]
    ].float()
    if slow:
        slow = sorted(slow)
        part = torch.tensor(slow)
        reference = _decide_reference(
            models.take(part),
            [steps[i] for i in slow],
            [rows[i] for i in slow],
            alpha_computer,
            None if alpha_init is None else alpha_init[part],
            outputs=None if outputs is None else [outputs[i] for i in slow],
            diversity=None if diversity is None else [diversity[i] for i in slow],
        )
        for name in ("tokens", "alpha", "logp", "logq", "ok"):
            getattr(result, name)[part] = getattr(reference, name).to("cpu", getattr(result, name).dtype)
    return result


def _decide_reference(
    models: ModelRows,
    steps: Sequence[int],
    rows: Sequence[RowSampling],
    alpha_computer: AlphaComputer,
    alpha_init: Tensor | None = None,
    top_logprobs: int = 0,
    outputs: Sequence[Sequence[int]] | None = None,
    diversity: Sequence[dict[int, int]] | None = None,
) -> Decision:
    """:func:`decide` in torch operations, for any row, any number of teachers and any device: the reference."""
    several = check_stages_for_teachers(rows, len(models.roster.teachers))
    logp = [
        rows_.float() if models.is_normalized(p) else torch.log_softmax(rows_.float(), dim=-1)
        for p, rows_ in enumerate(models.logits)
    ]
    logp_theta = logp[models.student_position]
    absent = models.absent_teachers  # [b, K]: teachers a row leaves out, weight 0
    if absent is not None:
        # Rows never computed stand in as θ's: at weight 0 they change no mixture, and no value of them is recorded
        # (the driver leaves their columns out of the sample).
        for k, p in enumerate(models.teacher_positions):
            logp[p] = torch.where(absent[:, k : k + 1], logp_theta, logp[p])
    logp_teachers = [logp[p] for p in models.teacher_positions]
    first = torch.tensor([r.force_first_token and s == 0 for r, s in zip(rows, steps)], device=logp_theta.device)
    if several:
        stacked = torch.stack(logp_teachers)  # [K, b, V]
        alpha = alpha_computer.compute_teachers(logp_theta, stacked, alpha_init, normalized=True, absent=absent).alpha
        # A forced first token is the teachers' alone: θ's weight goes to them, in their proportions.
        alpha = torch.where(first.unsqueeze(-1), clamp_total(alpha, 1.0, 1.0, absent), alpha)
        log_weights = geometric_log_weights_teachers(logp_theta, stacked, alpha)
    else:
        alpha = alpha_computer(logp_theta, logp_teachers[0], alpha_init=alpha_init, normalized=True)
        alpha = torch.where(first, torch.ones_like(alpha), alpha)
        log_weights = geometric_log_weights(logp_theta, logp_teachers[0], alpha)  # unnormalised: the draw normalises
    offset = None
    if any(needs_logit_offset(r) for r in rows):
        offset = _logit_offset(models, alpha)
    drawn = draw_tokens(
        log_weights,
        None if several else logp_teachers[0],
        steps,
        rows,
        True,
        top_logprobs,
        outputs=outputs,
        logit_offset=offset,
        diversity=diversity,
    )
    pick = drawn.tokens.unsqueeze(-1)
    top = (None,) * 3
    if drawn.top is not None:
        ids = drawn.top[0]
        top = (ids, drawn.top[1], torch.stack([model.gather(-1, ids) for model in logp], dim=1))
    at_token = torch.stack([model.gather(-1, pick).squeeze(-1) for model in logp], dim=-1)
    return Decision(drawn.tokens, alpha, at_token, drawn.logq, drawn.ok, *top)


def check_stages_for_teachers(rows: Sequence[RowSampling], teachers: int) -> bool:
    """Whether there are several teachers; then refuse, naming its fields, a stage a row uses that has no meaning."""
    for stage in STAGES if teachers > 1 else ():
        if not stage.several_teachers and any(stage.used(row) for row in rows):
            raise ValueError(f"{' / '.join(stage.fields)}: {stage.name} has no meaning with {teachers} teachers")
    return teachers > 1


def _student_shift(models: ModelRows, rows: list[int]) -> list[float] | None:
    """What makes θ's rows its raw logits again, for the kernel: 0 for raw rows, else the log-normalisers (None
    where they did not come)."""
    position = models.student_position
    if not models.is_normalized(position):
        return [0.0] * len(rows)
    normalisers = models.log_normaliser(position)
    return None if normalisers is None else normalisers[rows].tolist()


def _logit_offset(models: ModelRows, alpha: Tensor) -> Tensor:
    """``[b]`` float64 (1 − Σα_i)·L_θ + Σ α_i·L_i (α ``[b]`` or ``[b, K]``; L: each model's log Σ exp of its logits):
    added to the mixture's log-weights it gives the mixture's logits, whose sign the repetition penalty reads."""
    device = models.device

    absent = models.absent

    def log_normaliser(position: int) -> Tensor:
        if not models.is_normalized(position):
            return models.logits[position].double().logsumexp(-1)
        if absent is not None and bool(absent[:, position].all()):
            return torch.zeros(len(models), dtype=torch.float64, device=device)  # weight 0 in every row
        given = models.log_normaliser(position)
        if given is None:
            name = models.roster.names[position]
            raise ValueError(
                f"the repetition penalty needs {name}'s log-normalisers (ModelRows.log_normalisers; "
                "ModelRows.pair's theta_log_normalisers)"
            )
        given = given.to(device, torch.float64)
        # A row that left this teacher out weighs it 0; its normaliser was never computed.
        return given if absent is None else given.masked_fill(absent[:, position].to(device), 0.0)

    lse_theta = log_normaliser(models.student_position)
    lse_teachers = torch.stack([log_normaliser(p) for p in models.teacher_positions], dim=-1)  # [b, K]
    a = alpha.to(device, torch.float64).reshape(lse_teachers.shape)
    rest = theta_weight(a) if a.shape[-1] > 1 else 1 - a[:, 0]  # one teacher: the pair's arithmetic, unchanged
    return rest * lse_theta + (a * lse_teachers).sum(-1)
