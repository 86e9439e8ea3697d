"""Mixture rollouts inside TRL's own trainers (``dual_sampling.integrations.trl``), on CPU with tiny models.

GRPO (its importance-sampling correction on), RLOO and DistillationTrainer train a few steps each with their generation
replaced by mixture rollouts. Each rollout is re-scored by plain transformers against the student as it was at the
sync before it (a copy of the trainer's weights taken right after each sync) and the teacher's folder, in float64
(:func:`tests.oracles.assert_records_match_rescoring`). The tied student shares one engine pair across the tests of
this module; the untied one gets its own, which also checks that the engines stop with the ``with`` block.

TRL's own seams train on the same engines: GRPO through ``rollout_func`` and AsyncGRPOTrainer through its rollout
worker and weight transfer (on CPU through ``tests.async_grpo_on_cpu``), each judged on the tensors the trainer itself
holds (``tests/test_trl_seams.py`` covers their bookkeeping without engines).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dual_sampling.distill.mismatch import SamplerMismatchError, sampler_trainer_mismatch
from dual_sampling.integrations.trl import MixtureGeneration, MixtureRollouts, MixtureRolloutsConfig, sampling_options
from dual_sampling.options import EngineOptions
from dual_sampling.records import DualGenerationOutput, RequestRecord, SampleRecord
from dual_sampling.testing.tiny_models import tiny_pair
from tests.oracles import assert_records_match_rescoring, rescore
from tests.processes import settled, snapshot
from tests.tolerances import RESCORE_ATOL

pytestmark = pytest.mark.filterwarnings("ignore:TRL currently supports vLLM:UserWarning")

trl = pytest.importorskip("trl")

PROMPTS = [f"Question {i}: a farmer has {3 * i + 2} hens and buys {i + 1} more. How many hens now?" for i in range(8)]
ENGINE = dict(max_num_seqs=8, max_model_len=128)


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS})


def _common(tmp_path, **overrides):
    """Trainer settings shared by both trainers: float32 on CPU, every step logged, nothing saved."""
    settings = dict(
        output_dir=str(tmp_path),
        use_vllm=True,
        per_device_train_batch_size=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,  # large, so each step moves θ well past the check's tolerance
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        use_cpu=True,
    )
    return {**settings, **overrides}


def _grpo(rollouts, student, tmp_path, **overrides):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(num_generations=4, vllm_importance_sampling_correction=True, **_common(tmp_path, **overrides))
    reward = lambda completions, **_: [len(c) / 10 for c in completions]
    return rollouts.trainer(GRPOTrainer, model=str(student), reward_funcs=reward, args=args, train_dataset=_dataset())


def _rloo(rollouts, student, tmp_path):
    from trl import RLOOConfig, RLOOTrainer

    args = RLOOConfig(num_generations=2, **_common(tmp_path))
    reward = lambda completions, **_: [len(c) / 10 for c in completions]
    return rollouts.trainer(RLOOTrainer, model=str(student), reward_funcs=reward, args=args, train_dataset=_dataset())


def _distillation(rollouts, student, teacher, tmp_path):
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(gradient_checkpointing=False, **_common(tmp_path))
    return rollouts.trainer(
        DistillationTrainer, model=str(student), teacher_model=str(teacher), args=args, train_dataset=_dataset()
    )


class Recorder:
    """Every generate call of a trainer's backend: (the trainer's weights at the last sync, what TRL received, the
    records, the prompts TRL asked with)."""

    def __init__(self, backend: MixtureGeneration) -> None:
        self.snapshots: list[dict[str, torch.Tensor]] = []
        self.calls: list[tuple[int, tuple, object, list]] = []
        sync, generate = backend.sync_weights, backend.generate

        def recorded_sync():
            sync()
            self.snapshots.append(copy.deepcopy(backend.model.state_dict()))

        def recorded_generate(prompts, *args, **kwargs):
            returned = generate(prompts, *args, **kwargs)
            self.calls.append((len(self.snapshots) - 1, returned, backend.last_output, [list(p) for p in prompts]))
            return returned

        backend.sync_weights, backend.generate = recorded_sync, recorded_generate


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _check_rollouts(recorder: Recorder, teacher, student, vocab: int, logprobs_returned: bool, **sampling) -> int:
    """Each call's records against the student at its sync (``sampling``: the trainer's temperature and filters),
    and what TRL received against the records and the prompts it asked with, in their order."""
    hf_teacher, hf_student = _hf(teacher), _hf(student)
    checked = 0
    assert recorder.snapshots and recorder.calls
    for index, returned, out, asked in recorder.calls:
        assert index >= 0, "a generate call came before any sync"
        hf_student.load_state_dict(recorder.snapshots[index])
        for request in out.requests:
            checked += assert_records_match_rescoring(request, hf_teacher, hf_student, vocab, "kl_symmetry", **sampling)
        prompt_ids, completion_ids, logprobs, token_ids = returned
        # A request per group of TRL's repeated prompt, its samples in TRL's order: rollout i continues prompt i.
        samples = [s for r in out.requests for s in r.samples]
        assert [r.theta_prompt_token_ids for r in out.requests for _ in r.samples] == asked
        assert prompt_ids == asked
        assert completion_ids == [s.token_ids for s in samples]
        if logprobs_returned:
            assert logprobs == [[[q] for q in s.logq] for s in samples]
            assert token_ids == [[[t] for t in s.token_ids] for s in samples]
        else:
            assert logprobs is None and token_ids is None
    # Not vacuous: the second call's rollouts came from weights the first step changed beyond the tolerance.
    later = [out for index, _, out, _ in recorder.calls if index == 1]
    assert later, "no rollouts after the first optimizer step"
    hf_student.load_state_dict(recorder.snapshots[0])
    assert sampler_trainer_mismatch(hf_student, later[0].requests, vocab=vocab).max_abs > 1e-2
    return checked


def _losses(trainer) -> list[float]:
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses and all(math.isfinite(x) for x in losses), losses
    return losses


def _mixture_metrics(trainer) -> list[dict]:
    rows = [row for row in trainer.state.log_history if "mixture/alpha_mean" in row]
    assert len(rows) == trainer.state.max_steps
    for row in rows:
        assert 0.0 < row["mixture/alpha_mean"] < 1.0
        # The logged figure is the re-scoring check's own quantity (log π_θ of the rollouts against the trainer's
        # model), so it must be as small as that check's tolerance, not merely under the backend's 0.05 alarm.
        assert row["mixture/sampler_mismatch_max"] <= RESCORE_ATOL
    return rows


def _train_and_check(trainer, rollouts, pair, logprobs_returned: bool, **sampling) -> tuple[Recorder, list[dict]]:
    """Train, then check every rollout against re-scoring, the losses and the mixture's logged metrics."""
    teacher, student = pair
    recorder = Recorder(trainer.vllm_generation)
    trainer.train()
    assert _check_rollouts(recorder, teacher, student, rollouts.dual.vocab, logprobs_returned, **sampling) > 0
    _losses(trainer)
    return recorder, _mixture_metrics(trainer)


@pytest.fixture(scope="module")
def tied_pair():
    return tiny_pair("same", tied=True)


HINT = "Hint: add the two numbers. "


def hint_odd_questions(prompt: str) -> str | None:
    """The teacher sees a hint before odd-numbered questions (a privileged field, as self-distillation rows carry)."""
    number = int(prompt.split(":")[0].removeprefix("Question "))
    return HINT + prompt if number % 2 else None


@pytest.fixture(scope="module")
def rollouts(tied_pair):
    """One engine pair for every trainer of the tied student in this module; the teacher gets hints."""
    teacher, _ = tied_pair
    with MixtureRollouts(
        teacher=str(teacher), engine=EngineOptions(**ENGINE), teacher_prompt=hint_odd_questions
    ) as shared:
        yield shared


@pytest.mark.engine
def test_grpo_with_importance_correction_trains_on_mixture_rollouts_that_rescore_exactly(rollouts, tied_pair, tmp_path):
    recorder, rows = _train_and_check(_grpo(rollouts, tied_pair[1], tmp_path), rollouts, tied_pair, True)
    assert len(recorder.calls) == 2  # one batch of four rollouts per step
    # GRPO's correction ran on log q: its ratio exp(log π_θ − log q) is logged per step.
    assert all("sampling/importance_sampling_ratio/mean" in row for row in rows)
    assert [row["mixture/behaviour_version"] for row in rows] == [1.0, 2.0]


@pytest.mark.engine
def test_grpo_samples_at_its_temperature_and_filters_and_serves_a_context_the_engines_hold(
    rollouts, tied_pair, tmp_path
):
    sampling = dict(temperature=0.7, top_k=50, top_p=0.9)
    trainer = _grpo(
        rollouts,
        tied_pair[1],
        tmp_path,
        vllm_importance_sampling_mode="token_truncate",
        vllm_max_model_length=ENGINE["max_model_len"],  # GOLD passes its max_length here by default
        **sampling,
    )
    # The records' log q is the tempered, filtered law: the oracle applies the same temperature and filters.
    _train_and_check(trainer, rollouts, tied_pair, True, **sampling)
    with pytest.raises(ValueError, match="vllm_max_model_length=129"):
        _grpo(rollouts, tied_pair[1], tmp_path, vllm_max_model_length=ENGINE["max_model_len"] + 1)


@pytest.mark.engine
def test_distillation_trainer_on_mixture_rollouts_discards_log_q_and_rescores_exactly(rollouts, tied_pair, tmp_path):
    teacher, student = tied_pair
    recorder, _ = _train_and_check(_distillation(rollouts, student, teacher, tmp_path), rollouts, tied_pair, False)
    # Two steps of four cover the eight prompts: the odd ones' rollouts were drawn (and re-scored above) with the
    # teacher on its hinted prompt, the even ones' on the student's.
    tokenizer = rollouts.dual.tokenizer
    hinted = []
    for r in (r for _, _, out, _ in recorder.calls for r in out.requests):
        theta_text = tokenizer.decode(r.theta_prompt_token_ids)
        teacher_text = tokenizer.decode(r.teacher_prompt_token_ids)
        assert teacher_text == (hint_odd_questions(theta_text) or theta_text)
        hinted.append(teacher_text != theta_text)
    assert sorted(hinted) == [False] * 4 + [True] * 4


@pytest.mark.engine
def test_rloo_trains_on_mixture_rollouts_that_rescore_exactly(rollouts, tied_pair, tmp_path):
    _train_and_check(_rloo(rollouts, tied_pair[1], tmp_path), rollouts, tied_pair, False)


# ---------------------------------------------------------------------------- TRL's own seams, on the engines


def _pi_theta(hf_student, request, sample) -> torch.Tensor:
    """log π_θ of each of ``sample``'s tokens under ``hf_student`` (float64, temperature 1)."""
    rows = rescore(hf_student, list(request.theta_prompt_token_ids), list(sample.token_ids), hf_student.vocab_size)
    return rows.gather(-1, torch.tensor(sample.token_ids).unsqueeze(-1)).squeeze(-1)


@pytest.mark.engine
def test_grpo_through_its_rollout_func_holds_log_q_and_corrects_by_pi_theta_over_q(
    rollouts, tied_pair, tmp_path, monkeypatch
):
    """GRPO's ``rollout_func`` seam, two steps. TRL's own ``VLLMGeneration`` (built because ``use_vllm=True``, which
    TRL 1.16 needs to run its correction at all) is replaced by one that draws nothing; every rollout comes from
    q. Judged on TRL's own tensors: its sampling log-probabilities are the records' log q bit for bit (and those
    re-score in float64), its log π_θ re-scores, and its ratio is min(π_θ/q, cap)."""
    from trl.trainer import grpo_trainer

    from dual_sampling.integrations.trl_rollout_func import MixtureRolloutFunc
    from tests.test_trl_seams import _grpo as _grpo_with_rollout_func
    from tests.test_trl_seams import _held

    class DrawsNothing:
        def __init__(self, **fields):
            pass

        def sync_weights(self):
            pass

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", DrawsNothing)
    cap = 3.0
    func = MixtureRolloutFunc(rollouts)
    trainer = _grpo_with_rollout_func(
        func,
        tied_pair[1],
        tmp_path,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=cap,
    )
    recorder, held = Recorder(func.backend(trainer)), _held(trainer)
    trainer.train()
    teacher, student = tied_pair
    assert _check_rollouts(recorder, teacher, student, rollouts.dual.vocab, logprobs_returned=True) > 0
    assert len(held) == len(recorder.calls) == 2
    hf_student = _hf(student)
    for out, (index, _, records, _) in zip(held, recorder.calls, strict=True):
        samples = [(r, s) for r in records.requests for s in r.samples]
        hf_student.load_state_dict(recorder.snapshots[index])  # the trainer's weights when it scored the batch
        mask = out["completion_mask"].bool()
        for row, (request, sample) in enumerate(samples):
            tokens = mask[row]
            assert out["completion_ids"][row][tokens].tolist() == sample.token_ids
            held_q = out["sampling_per_token_logps"][row][tokens]
            assert torch.equal(held_q, torch.tensor(sample.logq, dtype=torch.float32))
            pi_theta = _pi_theta(hf_student, request, sample)
            torch.testing.assert_close(
                out["old_per_token_logps"][row][tokens].double(), pi_theta, atol=RESCORE_ATOL, rtol=0
            )
            expected = torch.exp(pi_theta - torch.tensor(sample.logq, dtype=torch.float64)).clamp(max=cap)
            ratio = out["importance_sampling_ratio"][row][tokens].double()
            torch.testing.assert_close(ratio, expected, rtol=3 * RESCORE_ATOL, atol=0)
    _losses(trainer)


@pytest.mark.engine
def test_async_grpo_through_its_protocols_trains_on_log_q_with_ratio_pi_theta_over_q(
    rollouts, tied_pair, tmp_path, monkeypatch
):
    """AsyncGRPOTrainer with the mixture's rollout worker and weight transfer, two steps, a sync after each. Judged
    on the trainer's own tensors inside its loss: each trained token's ``old_log_probs`` is its record's log q bit
    for bit (the records re-score in float64 against the weights that drew them), the trainer's log π_θ re-scores
    against its weights at that step, so PPO's ratio exp(log π_θ − old_log_probs) is π_θ/q; the clip is TRL's."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from dual_sampling.integrations.trl_async import mixture_async_seams
    from tests.async_grpo_on_cpu import train_async_grpo_on_cpu

    train_async_grpo_on_cpu(monkeypatch)
    teacher, student = tied_pair
    settings = {k: v for k, v in _common(tmp_path).items() if k != "use_vllm"}  # no such field: no vLLM here
    args = AsyncGRPOConfig(num_generations=4, token_budget=0, weight_sync_steps=1, **settings)
    reward = lambda completions, **_: [len(c) / 10 for c in completions]
    worker, transfer = mixture_async_seams(rollouts, str(student), args, train_dataset=_dataset(), reward_funcs=reward)
    trainer = AsyncGRPOTrainer(
        model=str(student),
        args=args,
        train_dataset=_dataset(),
        reward_funcs=reward,
        rollout_worker=worker,
        weight_transfer=transfer,
    )
    sent: dict[str, dict[str, torch.Tensor]] = {}  # theta version label → the weights pushed under it
    send = transfer.send_weights

    def recorded_send(iterator):
        pairs = [(name, tensor.detach().clone()) for name, tensor in iterator]
        send(iter(pairs))
        sent[rollouts.dual.weight_versions["theta"]] = dict(pairs)

    monkeypatch.setattr(transfer, "send_weights", recorded_send)
    drawn: list = []
    monkeypatch.setattr(rollouts.config, "on_rollouts", drawn.append)
    losses: list[tuple[dict, dict, torch.Tensor]] = []  # (inputs, the trainer's weights, its log π_θ per term)
    compute_loss, outputs = trainer.compute_loss, []
    hook = trainer.model.register_forward_hook(lambda module, args, output: outputs.append(output.log_probs.detach()))

    def recorded_loss(model, inputs, *rest, **kwargs):
        weights = copy.deepcopy(model.state_dict())
        loss = compute_loss(model, inputs, *rest, **kwargs)
        losses.append((inputs, weights, outputs[-1].flatten()[inputs["token_index"][inputs["token_index"] >= 0]]))
        return loss

    monkeypatch.setattr(trainer, "compute_loss", recorded_loss)
    try:
        trainer.train()
    finally:
        hook.remove()
        worker.stop()
    assert trainer.state.global_step == 2 and len(losses) == 2
    _losses(trainer)

    hf_teacher, hf_student = _hf(teacher), _hf(student)
    vocab = rollouts.dual.vocab
    records = {}  # (completion tokens, log q as float32) → (request, sample)
    for out in drawn:
        for request in out.requests:
            (version,) = {s.theta_version for s in request.samples}
            _, unexpected = hf_student.load_state_dict(sent[version], strict=False)  # trainable parameters only
            assert not unexpected, unexpected
            assert assert_records_match_rescoring(request, hf_teacher, hf_student, vocab, "kl_symmetry") > 0
            for sample in request.samples:
                key = (tuple(sample.token_ids), tuple(torch.tensor(sample.logq, dtype=torch.float32).tolist()))
                records[key] = (request, sample)
    trained_versions = set()
    for inputs, weights, pi_theta_trl in losses:
        hf_student.load_state_dict(weights)
        selected = inputs["token_index"] >= 0
        labels = inputs["shift_labels"][inputs["attention_mask"].bool()]
        tokens, old, segment = (
            labels[inputs["token_index"][selected]],
            inputs["old_log_probs"][selected],
            inputs["segment_id"][selected],
        )
        for i in segment.unique().tolist():
            terms = segment == i
            request, sample = records[(tuple(tokens[terms].tolist()), tuple(old[terms].tolist()))]
            trained_versions.add(sample.theta_version)
            pi_theta = _pi_theta(hf_student, request, sample)
            torch.testing.assert_close(pi_theta_trl[terms].double(), pi_theta, atol=RESCORE_ATOL, rtol=0)
            ratio = torch.exp(pi_theta_trl[terms].double() - old[terms].double())
            expected = torch.exp(pi_theta - torch.tensor(sample.logq, dtype=torch.float64))
            torch.testing.assert_close(ratio, expected, rtol=3 * RESCORE_ATOL, atol=0)
    assert trained_versions, "no trained sample was matched to its record"


@pytest.mark.engine
def test_a_sync_that_does_not_reach_the_engine_fails_the_next_batch_by_name(rollouts, tied_pair, tmp_path):
    _, student = tied_pair
    trainer = _grpo(rollouts, student, tmp_path, max_steps=3)
    backend = trainer.vllm_generation
    update, pushes = backend.dual.update_theta, []

    def first_push_only(weights, **kwargs):  # later syncs are lost on the way, as with a skipped update
        pushes.append(kwargs["version"])
        return update(weights, **kwargs) if len(pushes) == 1 else kwargs["version"]

    backend.dual.update_theta = first_push_only
    try:
        with pytest.raises(SamplerMismatchError, match="max_sampler_mismatch") as failure:
            trainer.train()
    finally:
        del backend.dual.update_theta
    assert len(pushes) == 2  # failed on the first batch after the lost sync, not later
    assert failure.value.mismatch.max_abs > 0.05


@pytest.mark.engine
def test_untied_student_engines_start_with_the_trainer_and_leave_nothing_behind(tmp_path):
    teacher, student = tiny_pair("same", tied=False)
    before = snapshot()
    with MixtureRollouts(teacher=str(teacher), engine=EngineOptions(**ENGINE)) as rollouts:
        assert rollouts.dual is None  # nothing runs before a trainer needs it
        trainer = _distillation(rollouts, student, teacher, tmp_path)
        pids = rollouts.dual.engine_pids()
        assert pids["teacher"] and pids["theta"]
        recorder = Recorder(trainer.vllm_generation)
        trainer.train()
        vocab = rollouts.dual.vocab
    assert rollouts.dual is None
    procs, files = settled(before)
    assert not procs and not files, (procs, files)
    assert _check_rollouts(recorder, teacher, student, vocab, logprobs_returned=False) > 0
    _losses(trainer)


# ---------------------------------------------------------------------------- bookkeeping: no engine starts


class StandInPair:
    """OptimalSamplingDual's stand-in for the backend's bookkeeping, built where the engines would start. Sample j of
    a prompt is two tokens, the prompt's last token and j (so the order TRL receives can be read off), each recorded
    with log π_θ = 0 (probability 1), which the random tiny student gives no token, so every sampler–trainer check
    that runs on a rollout fails. ``labels``: theta's version labels, in the order pushed; ``calls``: what each
    ``generate`` was called with."""

    vocab = None  # the check compares over the model's whole output
    max_model_len = ENGINE["max_model_len"]

    def __init__(self, teacher: str, student: str, **settings) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(teacher)  # teacher hints decode TRL's prompts with it
        self.labels: list[str] = []
        self.calls: list[dict] = []

    @property
    def weight_versions(self) -> dict[str, str]:
        return {"teacher": "0", "theta": self.labels[-1] if self.labels else "0"}

    def update_theta(self, weights, *, version=None, mode="wait") -> str:
        self.labels.append(version)
        return version

    def generate(
        self, prompts, teacher_prompts=None, *, sampling, prompt_keys=None, use_tqdm=True
    ) -> DualGenerationOutput:
        self.calls.append(dict(prompts=prompts, teacher_prompts=teacher_prompts, sampling=sampling, keys=prompt_keys))
        zeros = dict(alpha=[0.5] * 2, logp_teacher=[0.0] * 2, logp_theta=[0.0] * 2, logq=[0.0] * 2)
        return DualGenerationOutput(
            [
                RequestRecord(
                    i,
                    p if teacher_prompts is None else teacher_prompts[i],
                    p,
                    [
                        SampleRecord(text="x", token_ids=[p[-1], j], finish_reason="length", seed=0, **zeros)
                        for j in range(sampling.n)
                    ],
                )
                for i, p in enumerate(prompts)
            ]
        )

    def close(self) -> None:
        pass


@pytest.fixture
def stand_in(tied_pair, monkeypatch):
    """MixtureRollouts(**settings) whose engines are a :class:`StandInPair`."""
    import dual_sampling.api

    monkeypatch.setattr(dual_sampling.api, "OptimalSamplingDual", StandInPair)
    return lambda **settings: MixtureRollouts(teacher=str(tied_pair[0]), engine=EngineOptions(**ENGINE), **settings)


@pytest.fixture
def stand_in_rollouts(stand_in):
    """A MixtureRollouts whose engines are a :class:`StandInPair`."""
    return stand_in()


@pytest.fixture
def checked(monkeypatch):
    """The rollouts each sampler–trainer check re-scored (a list per check); the check passes, as the stand-in's
    records would fail it."""
    from dual_sampling.distill import mismatch

    seen: list[list] = []

    def record(model, requests, vocab=None):
        seen.append([(list(r.theta_prompt_token_ids), s.token_ids) for r in requests for s in r.samples])
        return mismatch.Mismatch(0.0, 0.0, sum(len(tokens) for _, tokens in seen[-1]))

    monkeypatch.setattr(mismatch, "sampler_trainer_mismatch", record)
    return seen


def test_an_empty_batch_after_a_sync_leaves_the_check_to_the_next_batch(stand_in_rollouts, tied_pair, tmp_path):
    backend = _grpo(stand_in_rollouts, tied_pair[1], tmp_path).vllm_generation
    backend.sync_weights()
    assert backend.generate([], None, 4) == ([], [], [], [])  # nothing to compare: not a pass
    with pytest.raises(SamplerMismatchError, match="'sync-1-step-0'.*max_sampler_mismatch"):
        backend.generate([[1, 2, 3]], None, 1)


def test_trainers_sharing_engines_never_share_a_version_label(stand_in_rollouts, tied_pair, tmp_path):
    first, second = (_grpo(stand_in_rollouts, tied_pair[1], tmp_path / name).vllm_generation for name in "ab")
    for backend in (first, second, first):  # each at its trainer's step 0
        backend.sync_weights()
    assert stand_in_rollouts.dual.labels == ["sync-1-step-0", "sync-2-step-0", "sync-3-step-0"]
    assert (first.behaviour_version, first._sync, second._sync) == ("sync-3-step-0", 3, 2)


A, B, C = [100, 101, 102], [200, 201], [300]


def test_each_prompt_group_is_one_request_of_n_samples_so_diversity_spans_it(stand_in, tied_pair, tmp_path, checked):
    """TRL repeats each prompt num_generations times in a row (its RepeatSampler): each group is sampled as n samples
    of one prompt, so diversity_penalty acts across it; rollout k still answers TRL's prompt k."""
    hinted: list[str] = []
    rollouts = stand_in(teacher_prompt=lambda text: (hinted.append(text), [7, 7])[1])
    trainer = _grpo(rollouts, tied_pair[1], tmp_path, generation_kwargs={"diversity_penalty": 0.5})
    backend = trainer.vllm_generation
    prompts = [A] * 4 + [B] * 4
    prompt_ids, completion_ids, logprobs, token_ids = backend.generate(prompts, None, 4)
    (call,) = rollouts.dual.calls
    assert (call["prompts"], call["teacher_prompts"], call["keys"]) == ([A, B], [[7, 7]] * 2, ["0", "4"])
    assert (call["sampling"].n, call["sampling"].diversity_penalty) == (4, 0.5)
    assert len(hinted) == 2  # the hint is asked once per group
    assert prompt_ids == prompts
    assert completion_ids == [[A[-1], j] for j in range(4)] + [[B[-1], j] for j in range(4)]
    assert token_ids == [[[t] for t in c] for c in completion_ids] and len(logprobs) == 8
    # The check re-scores mismatch_samples rollouts (8, here all), not as many groups of four.
    assert checked == [list(zip(prompts, completion_ids))]


def test_groups_of_other_sizes_keep_trls_order_and_each_rollout_its_own_seed(
    stand_in_rollouts, tied_pair, tmp_path, checked
):
    backend = _grpo(stand_in_rollouts, tied_pair[1], tmp_path).vllm_generation
    prompts = [A, A, B, C, C, C]  # runs cut at num_generations, as TRL groups them: AA, B, CC, C
    prompt_ids, completion_ids, _, _ = backend.generate(prompts, None, 2)
    calls = stand_in_rollouts.dual.calls
    assert [(c["prompts"], c["sampling"].n, c["keys"]) for c in calls] == [
        ([A, C], 2, ["0", "3"]),
        ([B, C], 1, ["2", "5"]),
    ]
    assert len({c["sampling"].seed for c in calls}) == 1  # one call's seed; rollout k's from (seed, key, member)
    assert prompt_ids == prompts
    assert completion_ids == [[A[-1], 0], [A[-1], 1], [B[-1], 0], [C[-1], 0], [C[-1], 1], [C[-1], 0]]
    out = backend.last_output
    assert [r.index for r in out.requests] == [0, 1, 2, 3]
    assert [s.token_ids for r in out.requests for s in r.samples] == completion_ids


def test_the_sampler_check_rescores_mismatch_samples_rollouts_spread_over_the_groups(
    stand_in, tied_pair, tmp_path, checked
):
    backend = _grpo(stand_in(mismatch_samples=2), tied_pair[1], tmp_path).vllm_generation
    backend.generate([A] * 4 + [B] * 4, None, 4)
    assert checked == [[(A, [A[-1], 0]), (B, [B[-1], 0])]]


def test_a_completion_length_or_context_the_engines_cannot_hold_is_refused_before_any_engine(
    stand_in_rollouts, tied_pair, tmp_path
):
    context = ENGINE["max_model_len"]
    with pytest.raises(ValueError, match=f"max_completion_length={context}: .*max_model_len={context}"):
        _grpo(stand_in_rollouts, tied_pair[1], tmp_path, max_completion_length=context)
    with pytest.raises(ValueError, match=f"vllm_max_model_length={context + 1}: .* hold {context} tokens"):
        _grpo(stand_in_rollouts, tied_pair[1], tmp_path, vllm_max_model_length=context + 1)
    assert stand_in_rollouts.dual is None
    _grpo(stand_in_rollouts, tied_pair[1], tmp_path, max_completion_length=context - 1)  # a 1-token prompt fits


LONG = [400] * 30  # 30 tokens leave 98 of 128: short of max_completion_length=100
FITS = [500] * 28  # exactly 100 left
SHORT = "which leaves {room} of max_model_len=128 for its completion, short of max_completion_length=100 "


@pytest.mark.parametrize(
    ("prompts", "hint", "failure"),
    [
        ([A] * 4 + [LONG] * 4, None, "prompt 4: theta's prompt has 30 tokens, " + SHORT.format(room=98) + r"\(4 of 8"),
        ([B] * 4 + [A] * 4, [7] * 40, "prompt 4: the teacher's hinted prompt has 40 tokens, " + SHORT.format(room=88)),
        ([FITS] * 4 + [A] * 4, [7] * 28, None),
    ],
)
def test_a_prompt_that_leaves_less_room_than_max_completion_length_fails_by_name_before_sampling(
    stand_in, tied_pair, tmp_path, checked, prompts, hint, failure
):
    """The longer of theta's prompt and the teacher's (A's, hinted) must leave max_completion_length=100 of the 128."""
    tokenizer = StandInPair(str(tied_pair[0]), "").tokenizer
    hinted = tokenizer.decode(A, skip_special_tokens=False)
    rollouts = stand_in(teacher_prompt=lambda text: hint if text == hinted else None)
    backend = _grpo(rollouts, tied_pair[1], tmp_path, max_completion_length=100).vllm_generation
    if failure is None:
        assert len(backend.generate(prompts, None, 4)[1]) == len(prompts)
        return
    with pytest.raises(ValueError, match=failure):
        backend.generate(prompts, None, 4)
    assert rollouts.dual.calls == []  # refused before any rollout was drawn


# ---------------------------------------------------------------------------- refusals: before any engine starts


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(vllm_mode="server"), "vllm_mode"),
        (dict(vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size"),
        (dict(vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode"),
        (dict(vllm_structured_outputs_regex="[0-9]+"), "vllm_structured_outputs_regex"),
        (dict(max_completion_length=None), "max_completion_length"),
        (dict(generation_kwargs={"frequency_penalty": 2.5}), "frequency_penalty"),
        (dict(generation_kwargs={"bad_words": ["x"]}), "bad_words"),
        (dict(generation_kwargs={"n": 2}), "'n'"),
        (dict(generation_kwargs={"use_beam_search": True}), "use_beam_search.*a beam search returns no samples"),
        (dict(generation_kwargs={"seed": -1}), r"generation_kwargs\['seed'\]"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(use_vllm=False), "use_vllm"),
    ],
)
def test_fields_the_mixture_cannot_serve_are_refused_by_name_before_any_engine(tied_pair, tmp_path, overrides, field):
    from trl.generation import vllm_generation
    from trl.trainer import grpo_trainer

    teacher, student = tied_pair
    rollouts = MixtureRollouts(teacher=str(teacher), engine=EngineOptions(**ENGINE))
    with pytest.raises(ValueError, match=field):
        _grpo(rollouts, student, tmp_path, **overrides)
    assert rollouts.dual is None
    # TRL's own class is back under its name in both modules.
    assert vllm_generation.VLLMGeneration is grpo_trainer.VLLMGeneration
    assert isinstance(vllm_generation.VLLMGeneration, type)


def test_every_field_trl_hands_its_generation_backend_is_handled():
    """A field a new TRL adds to VLLMGeneration is refused by name (never ignored) until this mapping handles it."""
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration

    from dual_sampling.integrations.trl import TRL_FIELDS

    handed = set(inspect.signature(VLLMGeneration.__init__).parameters) - {"self", "model", "accelerator"}
    assert handed == TRL_FIELDS


@pytest.mark.parametrize("hook", ["rollout_func", "environment_factory", "tools"])
def test_trainer_hooks_that_generate_by_other_means_are_refused_by_name(tied_pair, tmp_path, hook):
    from trl import GRPOConfig, GRPOTrainer

    teacher, student = tied_pair
    rollouts = MixtureRollouts(teacher=str(teacher), engine=EngineOptions(**ENGINE))
    args = GRPOConfig(num_generations=4, **_common(tmp_path))
    with pytest.raises(ValueError, match=hook):
        rollouts.trainer(GRPOTrainer, model=str(student), args=args, train_dataset=_dataset(), **{hook: [len]})
    assert rollouts.dual is None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(top_k=0, min_p=None, top_p=None), dict(top_k=-1, min_p=0.0, top_p=1.0, max_tokens=16)),
        (dict(temperature=0.7, generation_kwargs={"temperature": 0.5, "top_k": 20}), dict(temperature=0.5, top_k=20)),
        (dict(max_completion_length=32, generation_kwargs={"min_tokens": 4}), dict(max_tokens=32, min_tokens=4)),
    ],
)
def test_trl_sampling_fields_map_to_sampling_options_as_trl_applies_them(fields, expected):
    options, _ = sampling_options(fields)
    assert {name: getattr(options, name) for name in expected} == expected


@pytest.mark.parametrize(
    ("key", "value"), [("score", lambda prompt, sample: 0.0), ("top_logprobs", 2), ("dense_logprobs", 2)]
)
def test_generation_kwargs_whose_results_never_reach_trl_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=rf"generation_kwargs \['{key}'\]: .*TRL receives"):
        sampling_options({"generation_kwargs": {key: value}})


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (dict(max_sampler_mismatch=-1.0), "max_sampler_mismatch"),
        (dict(mismatch_samples=0), "mismatch_samples"),
        (dict(teacher_prompt="not callable"), "teacher_prompt"),
    ],
)
def test_backend_settings_are_checked_at_construction(settings, field):
    with pytest.raises(ValueError, match=field):
        MixtureRollouts(teacher="unused", **settings)
    with pytest.raises(ValueError, match="not both"):
        MixtureRollouts(MixtureRolloutsConfig(teacher="unused"), seed=1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(teacher={"math": "a"}), "teacher: a mapping names several teachers"),
        (dict(teacher={"math": "a", "theta": "b"}), "teacher: names must be unique"),
        (
            dict(teacher={"math": "a", "general": "b"}, teacher_prompt={"coach": str}),
            "teacher_prompt: 'coach' names no teacher",
        ),
        (dict(teacher="a", teacher_prompt={"math": str}), "teacher_prompt: a value per teacher name needs several"),
        (dict(teacher={"math": "a", "general": "b"}, teacher_prompt={}), "teacher_prompt: an empty mapping"),
        (
            dict(teacher={"math": "a", "general": "b"}, engine=EngineOptions(mode="speculative")),
            "mode='speculative' runs one teacher",
        ),
        (dict(teacher={"math": "a", "general": "b"}, teacher_prompt={"math": "x"}), r"teacher_prompt\['math'\] must"),
        (
            dict(teacher={"math": "a", "general": "b"}, engine=EngineOptions(alpha_method="fixed")),
            r"alpha must list one weight per teacher \(2\)",
        ),
    ],
)
def test_several_teachers_settings_are_checked_at_construction(settings, message):
    """A backend of several teachers names each of them; its hint functions and α must fit them, refused by field
    before any engine starts (tests/test_teachers_engine.py trains on a trio's rollouts)."""
    with pytest.raises(ValueError, match="^" + message):
        MixtureRollouts(**settings)
    config = MixtureRolloutsConfig(teacher={"math": "a", "general": "b"}, teacher_prompt={"math": str})
    assert config.roster.names == ("theta", "math", "general") and config.teacher_folders == ("a", "b")
