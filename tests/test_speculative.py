"""The speculative mixture rule (``dual_sampling.decision.speculative``) against independent oracles.

- Exactness: over many seeds, the first two tokens of speculative rounds on a bigram pair (every row known in closed
  form) follow q computed in float64 NumPy, by a chi-square test at level 0.001; the same test fails when the rule
  targets π_t instead of q (the positive control).
- The mean acceptance equals Σ min(π_θ, q) from float64 NumPy, within binomial error.
- Records (α, log π_t, log π_θ, log q) against float64 NumPy, for kl_symmetry, on every emitted token.
- Seeds reproduce whatever the batch; bad spans are refused by name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import inverse_cdf
from dual_sampling.decision.rows import ModelRows
from dual_sampling.decision.speculative import Span, stream_uniform, verify_drafts
from tests.draws import first_token_p
from tests.oracles import np_alpha_kl, np_log_softmax, np_mix
from tests.tolerances import ALPHA_ATOL, ALPHA_TWO_SOLVES_ATOL, ONE_NORMALISATION_ATOL, TWO_NORMALISATIONS_ATOL

VOCAB = 6
START = 0
GAMMA = 2
TRIALS = 12_000
LEVEL = 1e-3
"""The chi-square test's level: a correct rule fails it with probability 0.001 (the seeds are fixed, so the outcome is
the same every run)."""


def bigram_pair(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and theta logits ``[V, V]``: row ``prev`` is each model's next-token logits after token ``prev``."""
    g = torch.Generator().manual_seed(seed)
    return 1.2 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64), 0.8 * torch.randn(
        VOCAB, VOCAB, generator=g, dtype=torch.float64
    )


def draft(theta: torch.Tensor, last: list[int], seeds: list[int], steps: list[int]) -> list[int]:
    """Theta's draws after ``last`` (inverse CDF with the ``draft`` stream's uniforms)."""
    u = torch.tensor([stream_uniform(s, k, "draft") for s, k in zip(seeds, steps)], dtype=torch.float64)
    token, _ = inverse_cdf(torch.softmax(theta[last], -1), u)
    return token.tolist()


def first_two_tokens(teacher: torch.Tensor, theta: torch.Tensor, computer, seeds: list[int]) -> list[tuple[int, int]]:
    """Speculative rounds of γ = 2 drafts (with the bonus row) from START until every seed has two tokens."""
    emitted: list[list[int]] = [[] for _ in seeds]
    while True:
        active = [i for i, e in enumerate(emitted) if len(e) < 2]
        if not active:
            return [(e[0], e[1]) for e in emitted]
        last = [emitted[i][-1] if emitted[i] else START for i in active]
        steps = [len(emitted[i]) for i in active]
        act_seeds = [seeds[i] for i in active]
        y1 = draft(theta, last, act_seeds, steps)
        y2 = draft(theta, y1, act_seeds, [k + 1 for k in steps])
        prefixes = torch.tensor([[a, b, c] for a, b, c in zip(last, y1, y2)]).reshape(-1)
        spans = [
            Span(start=3 * k, drafts=(y1[k], y2[k]), seed=act_seeds[k], step=steps[k], bonus_row=True)
            for k in range(len(active))
        ]
        rounds = verify_drafts(ModelRows.pair(teacher[prefixes].float(), theta[prefixes].float()), spans, computer)
        for i, r in zip(active, rounds):
            emitted[i].extend(r.tokens)


def q_table(teacher: torch.Tensor, theta: torch.Tensor, alpha_of) -> np.ndarray:
    """q(· | prev) ``[V, V]`` in float64 NumPy, with α per row from ``alpha_of(log π_θ row, log π_t row)``."""
    rows = []
    for prev in range(VOCAB):
        lt, lth = np_log_softmax(teacher[prev].numpy()), np_log_softmax(theta[prev].numpy())
        rows.append(np_mix(lth, lt, alpha_of(lth, lt)))
    return np.array(rows)


def chi_square_p(pairs: list[tuple[int, int]], q: np.ndarray) -> float:
    expected = np.outer(q[START], np.ones(VOCAB)) * q * len(pairs)  # P(a, b) = q(a | START)·q(b | a)
    assert expected.min() >= 5, "too few expected counts for the chi-square approximation"
    observed = np.zeros((VOCAB, VOCAB))
    for a, b in pairs:
        observed[a, b] += 1
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = VOCAB * VOCAB - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize(
    ("method", "alpha_of"),
    [("fixed", lambda lth, lt: 0.4), ("kl_symmetry", np_alpha_kl)],
    ids=["fixed", "kl_symmetry"],
)
def test_emitted_tokens_follow_q(method, alpha_of):
    teacher, theta = bigram_pair()
    computer = get_alpha_computer(method, alpha=0.4) if method == "fixed" else get_alpha_computer(method)
    pairs = first_two_tokens(teacher, theta, computer, list(range(TRIALS)))
    assert chi_square_p(pairs, q_table(teacher, theta, alpha_of)) > LEVEL


def test_the_positive_control_fails_when_the_rule_targets_the_teacher():
    """The same rounds checked against π_t (α = 1) instead of q at α = 0.4: the test must reject them."""
    teacher, theta = bigram_pair()
    pairs = first_two_tokens(teacher, theta, get_alpha_computer("fixed", alpha=1.0), list(range(TRIALS)))
    assert chi_square_p(pairs, q_table(teacher, theta, lambda lth, lt: 0.4)) < LEVEL


def test_mean_acceptance_is_the_overlap_of_theta_and_q():
    """Each draft at START is accepted with probability Σ min(π_θ, q); over many seeds the rate matches it."""
    teacher, theta = bigram_pair()
    seeds = list(range(TRIALS))
    y1 = draft(theta, [START] * len(seeds), seeds, [0] * len(seeds))
    rows = torch.tensor([START] * len(seeds))
    spans = [Span(start=k, drafts=(y1[k],), seed=s, step=0) for k, s in enumerate(seeds)]
    rounds = verify_drafts(
        ModelRows.pair(teacher[rows].float(), theta[rows].float()), spans, get_alpha_computer("fixed", alpha=0.4)
    )
    rate = sum(r.accepted for r in rounds) / len(rounds)
    lth, lt = np_log_softmax(theta[START].numpy()), np_log_softmax(teacher[START].numpy())
    overlap = float(np.minimum(np.exp(lth), np_mix(lth, lt, 0.4)).sum())
    assert abs(rate - overlap) < 4 * math.sqrt(overlap * (1 - overlap) / len(rounds))
    assert all(len(r.tokens) == 1 for r in rounds)  # one draft: accepted, or replaced by the residual's draw


def test_records_against_float64():
    g = torch.Generator().manual_seed(11)
    teacher, theta = 3.0 * torch.randn(7, 300, generator=g), 1.5 * torch.randn(7, 300, generator=g)
    spans = [Span(0, (5, 17, 2), seed=1, step=0, bonus_row=True), Span(4, (9, 9), seed=2, step=7, bonus_row=True)]
    rounds = verify_drafts(ModelRows.pair(teacher, theta), spans, get_alpha_computer("kl_symmetry"))
    checked = 0
    for span, r in zip(spans, rounds):
        assert r.tokens[: r.accepted] == list(span.drafts[: r.accepted])
        assert len(r.tokens) == r.accepted + 1 or (r.accepted == len(span.drafts) and not span.bonus_row)
        for j, token in enumerate(r.tokens):
            lt = np_log_softmax(teacher[span.start + j].double().numpy())
            lth = np_log_softmax(theta[span.start + j].double().numpy())
            assert abs(float(r.alpha[j]) - np_alpha_kl(lth, lt)) < ALPHA_ATOL
            np.testing.assert_allclose(float(r.logp[j, 0]), lt[token], atol=ONE_NORMALISATION_ATOL, rtol=0)
            np.testing.assert_allclose(float(r.logp[j, 1]), lth[token], atol=ONE_NORMALISATION_ATOL, rtol=0)
            # log q at the recorded α (its error is checked above, not counted twice): a mixture of the two float32
            # log-softmaxes (their row constants cancel in it) normalised once more in float32.
            mixed = np.log(np_mix(lth, lt, float(r.alpha[j]))[token])
            np.testing.assert_allclose(float(r.logq[j]), mixed, atol=TWO_NORMALISATIONS_ATOL, rtol=0)
            checked += 1
    assert checked >= 2


def test_seeds_reproduce_whatever_the_batch():
    g = torch.Generator().manual_seed(4)
    teacher, theta = 2.0 * torch.randn(6, 200, generator=g), 2.0 * torch.randn(6, 200, generator=g)
    computer = get_alpha_computer("kl_symmetry")
    a, b = Span(0, (3, 4), seed=5, step=2, bonus_row=True), Span(3, (7, 8), seed=6, step=0, bonus_row=True)
    together = verify_drafts(ModelRows.pair(teacher, theta), [a, b], computer)
    alone = verify_drafts(ModelRows.pair(teacher[3:], theta[3:]), [Span(0, b.drafts, b.seed, b.step, True)], computer)
    assert together[1].tokens == alone[0].tokens
    # Two float32 computations of the same rows: α within two solves' bound; log q within two normalisations' each
    # way, plus the move of the float64 log q between the two α, at most Δα·(max d − min d) (d = log π_t − log π_θ).
    torch.testing.assert_close(together[1].alpha, alone[0].alpha, rtol=0, atol=ALPHA_TWO_SOLVES_ATOL)
    d = torch.log_softmax(teacher[3:].double(), -1) - torch.log_softmax(theta[3:].double(), -1)
    moved = ALPHA_TWO_SOLVES_ATOL * (d.amax(-1) - d.amin(-1)).max().item()
    torch.testing.assert_close(together[1].logq, alone[0].logq, rtol=0, atol=2 * TWO_NORMALISATIONS_ATOL + moved)
    again = verify_drafts(ModelRows.pair(teacher, theta), [b, a], computer)
    assert [r.tokens for r in again] == [together[1].tokens, together[0].tokens]


def test_alpha_zero_accepts_every_draft_and_draws_the_bonus_from_theta():
    """At α = 0, q is π_θ: no draft is rejected, and the bonus row is drawn from π_θ (a chi-square test of the bonus
    tokens' PITs under float64 softmax of theta's row; the same tokens judged under the teacher's row are rejected)."""
    g = torch.Generator().manual_seed(8)
    teacher, theta = torch.randn(4, 100, generator=g), torch.randn(4, 100, generator=g)
    spans = [Span(0, (1, 2, 3), seed=s, step=0, bonus_row=True) for s in range(2000)]
    rounds = verify_drafts(ModelRows.pair(teacher, theta), spans, get_alpha_computer("fixed", alpha=0.0))
    assert all(r.accepted == 3 and len(r.tokens) == 4 for r in rounds)
    assert [r.tokens[:3] for r in rounds] == [[1, 2, 3]] * len(rounds)
    bonus = [r.tokens[3] for r in rounds]
    theta_law = np.exp(np_log_softmax(theta[3].double().numpy()))
    teacher_law = np.exp(np_log_softmax(teacher[3].double().numpy()))
    assert first_token_p(bonus, theta_law, theta_law) > LEVEL
    assert first_token_p(bonus, teacher_law, teacher_law) < LEVEL, "the control: the test must tell the two rows apart"


def test_bad_spans_are_refused_by_name():
    rows = torch.zeros(3, 10)
    computer = get_alpha_computer("fixed")
    with pytest.raises(ValueError, match=r"spans\[1\]: rows"):
        verify_drafts(ModelRows.pair(rows, rows), [Span(0, (1,), 0, 0), Span(2, (1, 2), 0, 0)], computer)
    with pytest.raises(ValueError, match=r"spans\[0\]\.drafts"):
        verify_drafts(ModelRows.pair(rows, rows), [Span(0, (10,), 0, 0)], computer)


def test_the_speculative_driver_refuses_every_sampling_field_it_cannot_serve_by_name():
    """Every RowSampling field but the seed and the stop tokens, set away from its default, is refused by name (the
    list is derived from the dataclass, so a new field is refused until the mode serves it)."""
    import dataclasses

    from dual_sampling.decision.pipeline import RowSampling
    from dual_sampling.driver.requests import DualRequest
    from dual_sampling.driver.speculative_driver import SERVED, check_speculative

    changed = {
        "temperature": 0.5,
        "top_k": 3,
        "top_p": 0.9,
        "min_p": 0.1,
        "min_tokens": 2,
        "logit_bias": {1: 1.0},
        "force_first_token": True,
        "teacher_support_top_k": 5,
        "teacher_support_top_p": 0.9,
        "top_logprobs": 2,
        "dense_logprobs": 4,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "diversity_penalty": 1.0,
        "prompt_token_ids": (1, 2),
        "group": 5,
        "member": 1,
        "group_size": 2,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(RowSampling)} - set(SERVED)
    prompt = [5, 6, 7]
    ok = DualRequest(prompt, prompt, RowSampling(seed=3, stop_token_ids=(2,)), max_tokens=8)
    check_speculative(ok)
    for name, value in changed.items():
        bad = dataclasses.replace(ok, sampling=dataclasses.replace(ok.sampling, **{name: value}))
        with pytest.raises(ValueError, match=name):
            check_speculative(bad)
    with pytest.raises(ValueError, match="teacher_prompts"):
        check_speculative(dataclasses.replace(ok, teacher_prompt_ids=[9, *prompt]))
    with pytest.raises(ValueError, match="at least 2"):
        check_speculative(dataclasses.replace(ok, teacher_prompt_ids=[5], theta_prompt_ids=[5]))
    with pytest.raises(ValueError, match="stop token"):
        check_speculative(dataclasses.replace(ok, teacher_prompt_ids=[5, 2], theta_prompt_ids=[5, 2]))


def _sequential_rounds(teacher: torch.Tensor, theta: torch.Tensor, spans: list[Span], alpha: float) -> list:
    """The rule of the module docstring one draft at a time, in float64 NumPy (q at a fixed α), with the same
    uniforms: the oracle for the batched, device-side verification."""
    out = []
    for span in spans:
        tokens = []
        for j in range(span.rows):
            row = span.start + j
            lt, lth = np_log_softmax(teacher[row].double().numpy()), np_log_softmax(theta[row].double().numpy())
            q = np_mix(lth, lt, alpha)
            if j < len(span.drafts):
                y = span.drafts[j]
                if stream_uniform(span.seed, span.step + j, "accept") < q[y] / np.exp(lth[y]):
                    tokens.append(y)
                    continue
                weights = np.maximum(q - np.exp(lth), 0.0)
            else:
                weights = q
            u = stream_uniform(span.seed, span.step + j, "draw")
            tokens.append(int(np.searchsorted(np.cumsum(weights), u * weights.sum())))
            break
        out.append(tokens)
    return out


def test_the_batched_rounds_equal_the_rule_applied_one_draft_at_a_time():
    """Spans of every shape in one batch (no drafts with a bonus row, drafts without one, long and short rounds):
    the same tokens as the sequential rule in float64 with the same uniforms."""
    g = torch.Generator().manual_seed(21)
    teacher, theta = 2.5 * torch.randn(60, 40, generator=g), 2.0 * torch.randn(60, 40, generator=g)
    spans, start = [], 0
    for k in range(14):
        drafts = tuple(int(t) for t in torch.randint(0, 40, (k % 5,), generator=g))
        span = Span(start, drafts, seed=100 + k, step=k, bonus_row=k % 3 != 1 or not drafts)
        spans.append(span)
        start += span.rows
    rounds = verify_drafts(
        ModelRows.pair(teacher[:start], theta[:start]), spans, get_alpha_computer("fixed", alpha=0.6)
    )
    assert [r.tokens for r in rounds] == _sequential_rounds(teacher, theta, spans, 0.6)
    assert any(0 < r.accepted < len(s.drafts) for r, s in zip(rounds, spans))  # rejections inside rounds happened
    assert all(r.finite for r in rounds)


def test_a_non_finite_row_fails_its_span_alone():
    """NaN in the teacher, +inf in θ, and a θ row with no finite entry each fail their own span; the other's round
    is the one it has alone."""
    g = torch.Generator().manual_seed(5)
    teacher, theta = torch.randn(8, 30, generator=g), torch.log_softmax(torch.randn(8, 30, generator=g), -1)
    teacher[1, 4] = math.nan
    theta[4, 0] = math.inf
    theta[6] = -math.inf
    spans = [Span(0, (1, 2), 0, 0), Span(2, (3,), 1, 0, True), Span(4, (5,), 2, 0, True), Span(6, (7,), 3, 0, True)]
    computer = get_alpha_computer("kl_symmetry")
    rounds = verify_drafts(ModelRows.pair(teacher, theta, theta_normalized=True), spans, computer)
    assert [r.finite for r in rounds] == [False, True, False, False]
    alone = verify_drafts(
        ModelRows.pair(teacher[2:4], theta[2:4], theta_normalized=True), [Span(0, (3,), 1, 0, True)], computer
    )
    assert rounds[1].tokens == alone[0].tokens and torch.equal(rounds[1].logq, alone[0].logq)


def test_spans_with_no_rows_emit_nothing_and_leave_the_others_alone():
    g = torch.Generator().manual_seed(6)
    teacher, theta = torch.randn(2, 30, generator=g), torch.randn(2, 30, generator=g)
    computer = get_alpha_computer("fixed", alpha=0.5)
    rounds = verify_drafts(ModelRows.pair(teacher, theta), [Span(0, (1,), 0, 0, True), Span(2, (), 1, 0)], computer)
    assert rounds[1].tokens == [] and rounds[1].accepted == 0 and len(rounds[0].tokens) >= 1
    empty = verify_drafts(ModelRows.pair(teacher[:0], theta[:0]), [Span(0, (), 1, 0)], computer)
    assert empty[0].tokens == [] and empty[0].logq.shape == (0,)


class _DeviceWaits(torch.overrides.TorchFunctionMode):
    """Counts the calls that make the host wait for a tensor's device: a copy to the CPU (``.cpu()``, ``.to("cpu")``)
    and every read into Python or NumPy (``.numpy()``, ``.tolist()``, ``.item()``, ``float()``, ``int()``,
    ``bool()``). Counted at the torch-function level: on CPU tensors ``.cpu()``, ``.numpy()`` and ``.tolist()`` reach
    no dispatched operation, so a dispatch-level count would miss them here while they wait on a GPU."""

    READS = frozenset({"cpu", "numpy", "tolist", "item", "__float__", "__int__", "__bool__", "__index__"})

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        if not self.paused and (name in self.READS or to_cpu):
            self.waits += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", ["fixed", "kl_symmetry"])
def test_the_decision_waits_for_the_device_as_often_for_many_drafts_as_for_one(method):
    """The device-safety check run on CPU tensors (the same code runs on CUDA): no wait per draft or per span, so one
    span with one draft and 16 spans of 8 drafts make the same number of waits, and at least the one copy out is
    seen (the count can see a wait). The α solve's own convergence checks (a few per call, as many as its passes)
    are not counted: the count is of the verification itself. On the CPU the mixing also checks its rows for −inf
    (free there); that nothing is read back on a device is the next test's (a host read of a meta tensor raises)."""
    g = torch.Generator().manual_seed(9)
    solve = get_alpha_computer(method)
    mode = None

    def computer(*args, **kwargs):
        mode.paused = True
        try:
            return solve(*args, **kwargs)
        finally:
            mode.paused = False

    def waits(spans: int, gamma: int) -> int:
        rows = spans * (gamma + 1)
        teacher, theta = 2.0 * torch.randn(rows, 500, generator=g), torch.randn(rows, 500, generator=g)
        batch = [Span(k * (gamma + 1), tuple(range(gamma)), seed=k, step=0, bonus_row=True) for k in range(spans)]
        nonlocal mode
        with _DeviceWaits() as mode:
            rounds = verify_drafts(ModelRows.pair(teacher, theta), batch, computer)
        assert len(rounds) == spans
        return mode.waits

    few, many = waits(1, 1), waits(16, 8)
    assert few == many and few >= 1, (few, many)


def test_the_verification_runs_where_its_rows_are_without_reading_them_back():
    """The device-safety check off a GPU: the verification's device work on ``meta`` tensors, which have no data, so
    every input the host builds (uniforms, the spans' layout) must be sent to the rows' device (a CPU tensor meeting
    a meta one raises, as a CPU tensor meeting a CUDA one does) and nothing may be read back before the one wait (a
    host read of a meta tensor raises). The α solve reads its rows (its convergence checks) and is replaced by a
    device-pure stand-in: what is checked is the verification around it, the mixing included."""
    from dual_sampling.decision.speculative import verification_block

    def half(logp_theta, logp_teacher, alpha_init=None, normalized=False):
        return torch.full(logp_theta.shape[:1], 0.5, device=logp_theta.device)

    spans = [Span(0, (1, 2), 0, 0, True), Span(3, (), 1, 5, True), Span(4, (7, 7, 7), 2, 3)]
    rows = torch.empty(7, 300, device="meta")
    block = verification_block(ModelRows.pair(rows, rows, theta_normalized=True), spans, half)
    assert block.device.type == "meta" and block.shape == (3, 5 * 4 + 3)


def test_embedding_rows_are_read_where_vllm_reads_them_and_unequal_ones_are_refused_by_name():
    from dual_sampling.vocab import check_embedding_rows, embedding_rows

    assert embedding_rows({"vocab_size": 152_064}) == 152_064
    assert embedding_rows({"text_config": {"vocab_size": 262_208}}) == 262_208  # Gemma 3's multimodal checkpoints
    assert embedding_rows({}) is None
    check_embedding_rows(152_064, 151_936, 151_665, "lockstep")  # unequal padding: lockstep serves it
    with pytest.raises(ValueError, match="152064 embedding rows.*theta 151936.*mode='lockstep'"):
        check_embedding_rows(152_064, 151_936, 151_665, "speculative")
    with pytest.raises(ValueError, match="theta model has 100 embedding rows, fewer than the tokenizer's 151665"):
        check_embedding_rows(152_064, 100, 151_665, "lockstep")


def test_a_theta_with_sliding_and_full_attention_layers_is_refused_for_drafting_by_name():
    """vLLM 0.32's drafter needs one KV-cache group; Gemma 3's mixed layers make two (its engine failed to start)."""
    from dual_sampling.driver.speculative_engine import check_draft_model

    check_draft_model({"layer_types": ["full_attention", "full_attention"]})
    check_draft_model({})
    for config in (
        {"layer_types": ["sliding_attention", "full_attention"]},
        {"text_config": {"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}},
    ):
        with pytest.raises(ValueError, match="theta's attention layers are of 2 kinds.*mode='lockstep'"):
            check_draft_model(config)


def test_eos_ids_come_from_both_configs_of_both_models_and_the_tokenizer(tmp_path):
    """Qwen2.5's config.json names <|im_end|> alone; its generation_config adds <|endoftext|>, on which vLLM stops."""
    import json
    from types import SimpleNamespace

    from dual_sampling.vocab import eos_token_ids

    teacher, theta = tmp_path / "teacher", tmp_path / "theta"
    configs = ((teacher, {"eos_token_id": 2}, [2, 0]), (theta, {"text_config": {"eos_token_id": 7}}, None))
    for folder, config, generation in configs:
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        if generation is not None:
            (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation}))
    assert eos_token_ids([teacher, theta], SimpleNamespace(eos_token_id=9)) == [0, 2, 7, 9]
    with pytest.raises(ValueError, match="EOS"):
        eos_token_ids([tmp_path / "none"], SimpleNamespace(eos_token_id=None))
