"""TRL's own seams for mixture rollouts, without engines: GRPO's ``rollout_func``
(``dual_sampling.integrations.trl_rollout_func``) and AsyncGRPO's rollout worker and weight transfer
(``dual_sampling.integrations.trl_async``), on a stand-in for the engine pair (``tests.test_trl_backend.StandInPair``,
with a distinct log q per token so what TRL holds can be traced back to the records)."""

from __future__ import annotations

import inspect
import math
import queue

import pytest
import torch

from dual_sampling.integrations.trl import MixtureRollouts
from dual_sampling.options import EngineOptions
from dual_sampling.records import DualGenerationOutput, RequestRecord, SampleRecord
from tests.test_trl_backend import ENGINE, PROMPTS, StandInPair, _common, _dataset, checked, tied_pair  # noqa: F401

pytestmark = [
    pytest.mark.filterwarnings("ignore:TRL currently supports vLLM:UserWarning"),
    pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning"),
]

trl = pytest.importorskip("trl")


def logq_of(prompt: list[int], j: int) -> list[float]:
    """The stand-in's log q of sample j of ``prompt``'s two tokens: distinct per prompt, sample and position."""
    return [-0.5 - 0.25 * j - (prompt[-1] % 7) / 8, -1.5 - 0.25 * j]


class TracedPair(StandInPair):
    """StandInPair whose records carry :func:`logq_of`, α = 0.25, log π_θ = −0.5 and the theta version drawing
    them."""

    def generate(self, prompts, teacher_prompts=None, *, sampling, prompt_keys=None, use_tqdm=True):
        self.calls.append(dict(prompts=prompts, teacher_prompts=teacher_prompts, sampling=sampling, keys=prompt_keys))
        version = self.weight_versions["theta"]
        return DualGenerationOutput(
            [
                RequestRecord(
                    i,
                    p if teacher_prompts is None else teacher_prompts[i],
                    p,
                    [
                        SampleRecord(
                            text="x",
                            token_ids=[p[-1], j],
                            finish_reason="length",
                            seed=0,
                            alpha=[0.25, 0.25],
                            logp_teacher=[0.0, 0.0],
                            logp_theta=[-0.5, -0.5],
                            logq=logq_of(p, j),
                            theta_version=version,
                        )
                        for j in range(sampling.n)
                    ],
                )
                for i, p in enumerate(prompts)
            ]
        )


@pytest.fixture
def rollouts(tied_pair, monkeypatch):  # noqa: F811
    import dual_sampling.api

    monkeypatch.setattr(dual_sampling.api, "OptimalSamplingDual", TracedPair)
    return MixtureRollouts(teacher=str(tied_pair[0]), engine=EngineOptions(**ENGINE))


# ---------------------------------------------------------------------------- GRPO's rollout_func


def _grpo(rollout_func, student, tmp_path, **overrides):
    from trl import GRPOConfig, GRPOTrainer

    settings = {**_common(tmp_path, use_vllm=False), **overrides}
    args = GRPOConfig(num_generations=4, **settings)
    reward = lambda completions, **_: [len(c) / 10 for c in completions]
    return GRPOTrainer(
        model=str(student), reward_funcs=reward, args=args, train_dataset=_dataset(), rollout_func=rollout_func
    )


def _held(trainer) -> list[dict]:
    """What the trainer built from each batch (its inputs to the loss)."""
    held: list[dict] = []
    build = trainer._generate_and_score_completions

    def recorded(inputs):
        out = build(inputs)
        held.append(out)
        return out

    trainer._generate_and_score_completions = recorded
    return held


def _check_logq_held(held: list[dict]) -> None:
    """Each batch's sampling log-probabilities are the records' log q, token by token (rollout k continues its
    prompt's last token, so its log q is known from the completion TRL holds)."""
    assert held
    for out in held:
        logps, mask, completions = out["sampling_per_token_logps"], out["completion_mask"], out["completion_ids"]
        for row in range(completions.shape[0]):
            tokens = completions[row][mask[row].bool()].tolist()
            first, j = tokens  # [prompt's last token, sample index]
            expected = logq_of([first], j)
            assert logps[row][mask[row].bool()].tolist() == pytest.approx(expected)


def test_grpo_trains_with_the_rollout_func_and_holds_log_q(rollouts, tied_pair, tmp_path, checked):  # noqa: F811
    from dual_sampling.integrations.trl_rollout_func import MixtureRolloutFunc

    trainer = _grpo(MixtureRolloutFunc(rollouts), tied_pair[1], tmp_path)
    assert not trainer.use_vllm and rollouts.dual is None  # nothing starts before the first rollout
    held = _held(trainer)
    trainer.train()
    _check_logq_held(held)
    # The weights were pushed before the first batch and again when the step advanced.
    assert rollouts.dual.labels == ["sync-1-step-0", "sync-2-step-1"]
    # The prompts the pair drew from are TRL's tokenization of the dataset's prompts, one request per group.
    tokenizer = rollouts.dual.tokenizer
    drawn = [tokenizer.decode(p) for call in rollouts.dual.calls for p in call["prompts"]]
    assert drawn and all(text in PROMPTS for text in drawn)
    assert all(call["sampling"].n == 4 for call in rollouts.dual.calls)
    # Without use_vllm, TRL applies no importance-sampling correction (documented): no ratio in its inputs.
    assert all("importance_sampling_ratio" not in out for out in held)
    rows = [row for row in trainer.state.log_history if "mixture/alpha_mean" in row]
    assert len(rows) == 2 and all(row["mixture/alpha_mean"] == pytest.approx(0.25) for row in rows)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses and all(math.isfinite(x) for x in losses)


def test_with_use_vllm_grpo_corrects_by_exp_log_pi_minus_log_q(rollouts, tied_pair, tmp_path, checked, monkeypatch):  # noqa: F811
    """With use_vllm=True TRL builds its own VLLMGeneration (replaced here by a stand-in that only counts syncs) and
    runs its importance-sampling correction on the log q the function returned."""
    from trl.trainer import grpo_trainer

    from dual_sampling.integrations.trl_rollout_func import MixtureRolloutFunc

    class IdleEngine:
        syncs = 0

        def __init__(self, **fields):
            pass

        def sync_weights(self):
            IdleEngine.syncs += 1

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", IdleEngine)
    trainer = _grpo(
        MixtureRolloutFunc(rollouts),
        tied_pair[1],
        tmp_path,
        use_vllm=True,
        max_steps=1,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1e9,
    )
    held = _held(trainer)
    trainer.train()
    _check_logq_held(held)
    (out,) = held
    mask = out["completion_mask"].bool()
    ratio = out["importance_sampling_ratio"][mask]
    expected = torch.exp(out["old_per_token_logps"] - out["sampling_per_token_logps"])[mask]
    assert torch.allclose(ratio, expected)
    assert IdleEngine.syncs == 1 and rollouts.dual.labels == ["sync-1-step-0"]


def test_weights_are_pushed_once_per_step(rollouts, tied_pair, tmp_path, checked):  # noqa: F811
    from dual_sampling.integrations.trl_rollout_func import MixtureRolloutFunc

    func = MixtureRolloutFunc(rollouts)
    trainer = _grpo(func, tied_pair[1], tmp_path)
    prompts = [PROMPTS[0]] * 4
    out = func(prompts, trainer)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"}
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == 4
    assert out["logprobs"] == [logq_of(out["prompt_ids"][0], j) for j in range(4)]
    func(prompts, trainer)  # the same step: no push
    assert rollouts.dual.labels == ["sync-1-step-0"]
    trainer.state.global_step = 3
    func(prompts, trainer)
    assert rollouts.dual.labels == ["sync-1-step-0", "sync-2-step-3"]


def test_tool_calling_trainers_are_refused_by_name(rollouts, tied_pair, tmp_path):  # noqa: F811
    from dual_sampling.integrations.trl_rollout_func import MixtureRolloutFunc

    def lookup(x: str) -> str:
        """Look x up.

        Args:
            x: the key.
        """
        return x

    func = MixtureRolloutFunc(rollouts)
    trainer = _grpo(func, tied_pair[1], tmp_path)
    trainer.tools = [lookup]
    with pytest.raises(ValueError, match="tools"):
        func([PROMPTS[0]] * 4, trainer)
    assert rollouts.dual is None
    with pytest.raises(TypeError, match="MixtureRollouts"):
        MixtureRolloutFunc("not a backend")


# ---------------------------------------------------------------------------- AsyncGRPO's protocols


def _protocol_members(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


@pytest.mark.parametrize(
    ("protocol_name", "ours"),
    [("RolloutWorkerProtocol", "MixtureRolloutWorker"), ("WeightTransferProtocol", "MixtureWeightTransfer")],
)
def test_the_async_seams_have_every_member_of_trls_protocols(protocol_name, ours):
    """TRL's protocols are not runtime_checkable (isinstance would raise), so each member is compared by signature."""
    import typing

    from trl.experimental.async_grpo import async_grpo_trainer

    from dual_sampling.integrations import trl_async

    protocol, cls = getattr(async_grpo_trainer, protocol_name), getattr(trl_async, ours)
    if getattr(protocol, "_is_runtime_protocol", False):  # a later TRL may make it so
        assert issubclass(cls, protocol)
    members = _protocol_members(protocol)
    assert members
    for name in members:
        theirs, mine = inspect.signature(getattr(protocol, name)), inspect.signature(getattr(cls, name))
        assert list(theirs.parameters) == list(mine.parameters), name
    assert set(typing.get_type_hints(protocol)) <= {"rollout_buffer", "metrics_queue"}


def _seams(rollouts, tied_pair, reward):  # noqa: F811
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from dual_sampling.integrations.trl_async import mixture_async_seams

    args = AsyncGRPOConfig(
        output_dir="unused", num_generations=4, max_completion_length=6, token_budget=0, report_to=[], use_cpu=True
    )
    return mixture_async_seams(rollouts, str(tied_pair[1]), args, train_dataset=_dataset(), reward_funcs=reward)


def _reward(completions, completion_ids, **_):
    return [float(ids[1]) for ids in completion_ids]  # sample j gets reward j


def test_the_async_worker_and_transfer_draw_score_and_version_samples(rollouts, tied_pair):  # noqa: F811
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    worker, transfer = _seams(rollouts, tied_pair, _reward)
    assert isinstance(worker.rollout_buffer, queue.Queue) and isinstance(worker.metrics_queue, queue.Queue)
    transfer.init_weight_transfer()  # the trainer's train-begin order: init, sync, then start
    transfer.pause()
    model = AutoModelForCausalLM.from_pretrained(str(tied_pair[1]))
    transfer.send_weights(model.named_parameters())
    transfer.resume()
    worker.update_model_version(1)
    assert rollouts.dual.labels == ["sync-1-version-1"] and transfer.version_of("sync-1-version-1") == 1

    samples = worker.draw_group()
    assert len(samples) == 4 and all(isinstance(s, RolloutSample) for s in samples)
    (call,) = rollouts.dual.calls
    (prompt_ids,) = call["prompts"]
    assert call["sampling"].n == 4 and call["sampling"].max_tokens == 6
    rewards = [0.0, 1.0, 2.0, 3.0]
    mean, std = 1.5, math.sqrt(1.25)
    for j, s in enumerate(samples):
        assert s.prompt == PROMPTS[0] and s.group_id == 0 and s.model_version == 1
        assert s.input_ids.tolist() == [*prompt_ids, prompt_ids[-1], j]
        assert s.completion_mask.tolist() == [0] * len(prompt_ids) + [1, 1]
        assert s.old_log_probs.tolist() == pytest.approx([0.0] * len(prompt_ids) + logq_of(prompt_ids, j))
        assert s.advantage == pytest.approx((rewards[j] - mean) / (std + 1e-8))
        assert s.metrics["reward"] == rewards[j] and s.metrics["rewards/_reward"] == rewards[j]
        assert s.metrics["mixture/alpha_mean"] == pytest.approx(0.25)
    assert worker.metrics_queue.get_nowait()["mixture/log_theta_minus_log_q"] == pytest.approx(
        sum(-0.5 - q for j in range(4) for q in logq_of(prompt_ids, j)) / 8
    )

    worker.start()  # the thread fills the buffer with the next groups
    sample = worker.rollout_buffer.get(timeout=30)
    assert sample.group_id == 1 and sample.prompt == PROMPTS[1]
    worker.check_health(stale_after_s=60)
    worker.stop()
    transfer.destroy()


def test_a_failing_reward_function_surfaces_at_the_trainers_health_check(rollouts, tied_pair):  # noqa: F811
    def broken(**_):
        raise ZeroDivisionError("reward")

    worker, transfer = _seams(rollouts, tied_pair, broken)
    transfer.init_weight_transfer()
    worker.start()
    worker._thread.join(timeout=30)
    with pytest.raises(RuntimeError, match="failed") as failure:
        worker.check_health(stale_after_s=60)
    assert isinstance(failure.value.__cause__, ZeroDivisionError)
    worker.stop()


def test_the_async_seams_need_a_token_budget(rollouts, tied_pair):  # noqa: F811
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from dual_sampling.integrations.trl_async import mixture_async_seams

    args = AsyncGRPOConfig(output_dir="unused", report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="token_budget"):
        mixture_async_seams(rollouts, str(tied_pair[1]), args, train_dataset=_dataset())
