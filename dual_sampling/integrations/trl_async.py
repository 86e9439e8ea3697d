"""Mixture rollouts for TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``), through its two seams.

TRL 1.16's asynchronous trainer takes a ``rollout_worker`` (its ``RolloutWorkerProtocol``: ``rollout_buffer`` and
``metrics_queue`` queues, ``start``, ``stop``, ``update_model_version``, ``check_health``) and a ``weight_transfer``
(its ``WeightTransferProtocol``: ``init_weight_transfer``, ``pause``, ``send_weights``, ``resume``, ``destroy``).
:class:`MixtureRolloutWorker` and :class:`MixtureWeightTransfer` implement them on one
:class:`~dual_sampling.OptimalSamplingDual`, so no vLLM server is needed::

    with MixtureRollouts(teacher="models/teacher", engine=EngineOptions(alpha_method="trust_region")) as rollouts:
        args = AsyncGRPOConfig(token_budget=..., ...)  # set: else the trainer asks a vLLM server for it
        worker, transfer = mixture_async_seams(rollouts, "models/student", args, train_dataset=data, reward_funcs=r)
        trainer = AsyncGRPOTrainer(model="models/student", args=args, train_dataset=data, reward_funcs=r,
                                   rollout_worker=worker, weight_transfer=transfer)
        trainer.train()

What the trainer does with them (read in TRL 1.16's ``async_grpo_trainer.py``): on train begin it calls
``init_weight_transfer`` (the engines start here), syncs (``pause``, ``send_weights`` with every trainable parameter
under its checkpoint name, ``resume``), bumps its ``model_version`` and tells the worker, then ``start``s the worker;
every ``weight_sync_steps`` optimizer steps it syncs again. It drains ``rollout_buffer``, drops samples more than
``max_staleness`` versions old, and trains with PPO's clipped objective on the ratio exp(log π_θ,T − old_log_probs).
Each sample's ``old_log_probs`` here is log q of its completion tokens (0 on the prompt), so that ratio is π_θ,T/q:
tokens whose ratio leaves [1 − ε, 1 + ε] in the direction of their advantage get no gradient, which, where the teacher
pulled q far from π_θ, can be most of them (TRL logs ``clip_ratio/*``).

Not served: tools, environments, image prompts (text and chat prompts only), and the sampler–trainer check of the
synchronous backends (the trainer's model moves on while the worker samples, so there is no single θ to compare).
``AsyncGRPOTrainer`` itself runs its attention through FA3's kernel (GPUs only); the tests train it on CPU with that
kernel's function in plain torch (``tests/async_grpo_on_cpu.py``).

α is the teacher weight throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dual_sampling.checks import need_int
from dual_sampling.integrations.trl import (
    MixtureRollouts,
    RolloutFailed,
    check_room,
    generation_teacher_prompts,
    sampling_options,
    teacher_prompts,
)

__all__ = ["MixtureRolloutWorker", "MixtureWeightTransfer", "MixtureWorkerConfig", "mixture_async_seams"]


class MixtureWeightTransfer:
    """``WeightTransferProtocol`` on the theta engine: each ``send_weights`` is one ``update_theta``.

    ``student``: the trainer's model folder (the theta engine starts from it at ``init_weight_transfer``). Version k
    (the trainer's ``model_version`` after its k-th sync) is pushed under the label ``sync-<n>-version-<k>`` (n counts
    every sync of ``rollouts``, as :class:`MixtureRollouts` labels them); :attr:`versions` maps each label to k, so a
    record's ``theta_version`` names the trainer's version that drew it.
    """

    def __init__(self, rollouts: MixtureRollouts, student: str) -> None:
        self.rollouts = rollouts
        self.student = str(student)
        self.versions: dict[str, int] = {}
        """theta version label → the trainer's model_version it carries (the engine's starting weights: 0)."""
        self._sent = 0
        self._lock = threading.Lock()

    @property
    def dual(self) -> Any:
        """The running engines (started by :meth:`init_weight_transfer`)."""
        if self.rollouts.dual is None:
            raise RuntimeError("the engines have not started: the trainer calls init_weight_transfer on train begin")
        return self.rollouts.dual

    def init_weight_transfer(self) -> None:
        """Start the engines (the theta engine from ``student``); its starting weights are version 0."""
        dual = self.rollouts.start(self.student)
        with self._lock:
            self.versions.setdefault(dual.weight_versions["theta"], 0)

    def pause(self) -> None:
        """Nothing to do: ``update_theta`` lets the requests in flight finish on the old weights and starts every
        later one on the new, so no sample mixes two versions."""

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Push the streamed ``(name, tensor)`` pairs as one state dict. ``update_theta`` checks them against the
        checkpoint first: a missing tensor (TRL streams trainable parameters only, so a student with frozen
        parameters) is refused by name."""
        state = {name: tensor.detach() for name, tensor in iterator}
        with self._lock:
            version = self._sent + 1
            n, _ = self.rollouts.next_sync(version)
            label = f"sync-{n}-version-{version}"
            self.versions[label] = version
        self.dual.update_theta(state, version=label)
        with self._lock:
            self._sent = version

    def resume(self) -> None:
        """Nothing to do (see :meth:`pause`)."""

    def destroy(self) -> None:
        """Nothing to release here: the engines belong to ``rollouts`` and stop when it closes."""

    def version_of(self, label: str) -> int:
        """The trainer's model_version of a theta version label (KeyError for a label this transfer never pushed)."""
        with self._lock:
            return self.versions[label]


@dataclass
class MixtureWorkerConfig:
    """What the worker reads of the trainer's settings (:func:`mixture_async_seams` fills it from an
    ``AsyncGRPOConfig``)."""

    num_generations: int = 8
    """Rollouts per prompt (one request of that many samples: a group, whose rewards are normalised together)."""
    max_completion_length: int = 256
    """Token cap of each completion."""
    temperature: float = 1.0
    """Sampling temperature on q (the trainer scores log π_θ at the same temperature)."""
    top_p: float = 1.0
    """Nucleus filter on q."""
    top_k: int = 0
    """Top-k filter on q (0: off)."""
    min_p: float = 0.0
    """Min-p filter on q."""
    repetition_penalty: float = 1.0
    """Repetition penalty on the mixture's logits (the returned log q is the penalised law's)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the tokenizer's ``apply_chat_template`` for conversational prompts."""
    queue_maxsize: int = 1024
    """Capacity of ``rollout_buffer`` (0: unbounded); the worker waits while it is full."""

    def __post_init__(self) -> None:
        need_int("num_generations", self.num_generations, 1)
        need_int("queue_maxsize", self.queue_maxsize, 0)


class MixtureRolloutWorker:
    """``RolloutWorkerProtocol`` in a thread of the trainer's process: draws groups from q, scores them, queues
    TRL ``RolloutSample``\\ s.

    Cycles through ``dataset`` (rows with a ``prompt``: text or a conversation's messages); each row is one request
    of ``num_generations`` samples (its teacher prompt from :attr:`MixtureRolloutsConfig.teacher_prompt`, asked with
    the student's prompt decoded, as in :class:`MixtureGeneration`). Each group is scored by ``reward_funcs``, called
    as TRL's worker calls them (``prompts``, ``completions``, ``completion_ids`` and the row's other columns, one entry
    per rollout; a None reward is NaN), and its advantages are TRL's: (r − mean)/(std + 1e-8) over the scored rollouts,
    0 for a rollout that no function scored. A sample's ``model_version`` is the trainer's version whose weights drew
    it (its record's ``theta_version``, through ``transfer``), ``old_log_probs`` 0 on the prompt and log q on the
    completion, ``metrics`` TRL's (``reward``, ``reward_std``, ``rewards/<name>``) and ``mixture/alpha_mean`` (the
    rollout's mean α). A failed rollout or a raising reward function stops the worker; the trainer's next
    ``check_health`` raises it.
    """

    def __init__(
        self,
        rollouts: MixtureRollouts,
        transfer: MixtureWeightTransfer,
        *,
        dataset: Any,
        reward_funcs: Callable[..., Any] | list[Callable[..., Any]] | None,
        tokenizer: Any,
        config: MixtureWorkerConfig | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.transfer = transfer
        self.dataset = dataset
        funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not all(callable(f) for f in funcs):
            raise ValueError("reward_funcs: the mixture worker calls plain functions (no reward models)")
        self.reward_funcs = funcs
        self.reward_func_names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
        self.tokenizer = tokenizer
        self.config = config or MixtureWorkerConfig()
        self.sampling, seed = sampling_options(
            dict(
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                top_k=self.config.top_k,
                min_p=self.config.min_p,
                repetition_penalty=self.config.repetition_penalty,
                max_completion_length=self.config.max_completion_length,
                logprobs=0,
            )
        )
        self._seeds = itertools.count(rollouts.config.seed if seed is None else seed)
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=self.config.queue_maxsize)
        """Scored ``RolloutSample``\\ s, drained by the trainer."""
        self.metrics_queue: queue.Queue = queue.Queue()
        """Per-group ``{metric: value}`` dicts (``mixture/*``), drained by the trainer's ``log``."""
        self.model_version = 0
        """The trainer's live version (``update_model_version``)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._heartbeat = time.time()
        self._group_ids = itertools.count()
        self._rows: Iterator[Any] = iter(())

    # ------------------------------------------------------------------ the protocol

    def start(self) -> None:
        """Start drawing in a daemon thread (the trainer calls this once, after its first weight sync)."""
        if self._thread is not None:
            return
        self._heartbeat = time.time()
        self._thread = threading.Thread(target=self._run, name="mixture-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the group being drawn (the engines belong to ``rollouts``)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=60)

    def update_model_version(self, model_version: int) -> None:
        """Record the trainer's live version (the samples carry the version that drew them, not this one)."""
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise the worker's failure, or if it produced nothing for ``stale_after_s`` seconds."""
        if self._failure is not None:
            raise RuntimeError("the mixture rollout worker failed; see the chained exception") from self._failure
        age = time.time() - self._heartbeat
        if self._thread is not None and age > stale_after_s:
            raise RuntimeError(f"the mixture rollout worker produced nothing for {age:.0f}s (> {stale_after_s:.0f}s)")

    # ------------------------------------------------------------------ drawing

    @property
    def dual(self) -> Any:
        """The running engines (the transfer's)."""
        return self.transfer.dual

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for sample in self.draw_group():
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=1.0)
                            break
                        except queue.Full:
                            continue
                self._heartbeat = time.time()
        except BaseException as error:  # kept for check_health: the trainer's thread raises it
            self._failure = error

    def _next_row(self) -> Any:
        try:
            return next(self._rows)
        except StopIteration:
            self._rows = iter(self.dataset)
            return next(self._rows)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        ids = self.tokenizer.apply_chat_template(
            list(prompt), tokenize=True, add_generation_prompt=True, **self.config.chat_template_kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def draw_group(self) -> list[Any]:
        """Draw, score and return the next dataset row's group of ``num_generations`` samples (what the thread
        queues)."""
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        row = self._next_row()
        prompt = row["prompt"]
        if "image" in row or "images" in row:
            raise ValueError("images: mixture rollouts serve text prompts only")
        prompt_ids = self._prompt_ids(prompt)
        n = self.config.num_generations
        teachers = teacher_prompts(self.rollouts, self.dual.tokenizer, [prompt_ids])
        check_room(self.dual.max_model_len, self.sampling.max_tokens, [prompt_ids] * n, [(0, n)], teachers)
        group_id = next(self._group_ids)
        out = self.dual.generate(
            [prompt_ids],
            generation_teacher_prompts(teachers),
            sampling=dataclasses.replace(self.sampling, seed=next(self._seeds), n=n),
            prompt_keys=[str(group_id)],
            use_tqdm=False,
        )
        (request,) = out.requests
        failed = [s.error for s in request.samples if s.error is not None]
        if failed:
            raise RolloutFailed(f"{len(failed)} of {n} rollouts of group {group_id} failed: {failed[0]}")
        if self.rollouts.config.on_rollouts is not None:
            self.rollouts.config.on_rollouts(out)
        samples = request.samples
        texts = self.tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
        conversational = not isinstance(prompt, str)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        advantages, rewards, per_func, reward_std = self._score(row, prompt, completions, samples)
        now = time.time()
        self._metrics(samples)
        ids = list(request.theta_prompt_token_ids)
        result = []
        for i, s in enumerate(samples):
            alpha = statistics.fmean(s.total_alpha) if s.total_alpha else float("nan")
            metrics = {
                "reward": rewards[i],
                "reward_std": reward_std,
                **{f"rewards/{name}": per_func[k][i] for k, name in enumerate(self.reward_func_names)},
                "mixture/alpha_mean": alpha,
            }
            result.append(
                RolloutSample(
                    prompt=prompt,
                    completion=completions[i],
                    input_ids=_array(ids + list(s.token_ids), "int64"),
                    completion_mask=_array([0] * len(ids) + [1] * len(s.token_ids), "int64"),
                    old_log_probs=_array([0.0] * len(ids) + [float(q) for q in s.logq], "float32"),
                    advantage=advantages[i],
                    model_version=self.transfer.version_of(s.theta_version),
                    group_id=group_id,
                    metrics=metrics,
                    enqueued_at=now,
                )
            )
        return result

    def _score(self, row: Any, prompt: Any, completions: list, samples: list) -> tuple:
        n = len(samples)
        kwargs = {k: [row[k]] * n for k in row if k not in {"prompt", "completion", "completion_ids"}}
        per_func = []
        for func in self.reward_funcs:
            values = func(
                prompts=[prompt] * n, completions=completions, completion_ids=[s.token_ids for s in samples], **kwargs
            )
            per_func.append([float("nan") if v is None else float(v) for v in values])
        scored = [
            (i, sum(f[i] for f in per_func if not math.isnan(f[i])))
            for i in range(n)
            if per_func and any(not math.isnan(f[i]) for f in per_func)
        ]
        rewards = [float("nan")] * n
        for i, r in scored:
            rewards[i] = r
        advantages = [0.0] * n
        reward_std = float("nan")
        if scored:
            values = [r for _, r in scored]
            mean, reward_std = statistics.fmean(values), statistics.pstdev(values)
            for i, r in scored:
                advantages[i] = (r - mean) / (reward_std + 1e-8)
        return advantages, rewards, per_func, reward_std

    def _metrics(self, samples: list) -> None:
        per_rollout = [statistics.fmean(alpha) for alpha in (s.total_alpha for s in samples) if alpha]
        gaps = [t - q for s in samples for t, q in zip(s.logp_theta, s.logq)]
        metrics: dict[str, float] = {}
        if per_rollout:  # the mean is each sample's own metric (mixture/alpha_mean), averaged by TRL's collator
            metrics["mixture/alpha_min"] = min(per_rollout)
            metrics["mixture/alpha_max"] = max(per_rollout)
        if gaps:
            metrics["mixture/log_theta_minus_log_q"] = statistics.fmean(gaps)
        if metrics:
            with contextlib.suppress(queue.Full):  # a trainer that stops draining never blocks drawing
                self.metrics_queue.put_nowait(metrics)


def _array(values: list, dtype: str) -> Any:
    import numpy as np

    return np.asarray(values, dtype=dtype)


def mixture_async_seams(
    rollouts: MixtureRollouts,
    student: str,
    args: Any,
    *,
    train_dataset: Any,
    reward_funcs: Callable[..., Any] | list[Callable[..., Any]] | None = None,
    processing_class: Any = None,
) -> tuple[MixtureRolloutWorker, MixtureWeightTransfer]:
    """The worker and the transfer for ``AsyncGRPOTrainer(model=student, args=args, ...)``, reading the sampling
    settings of ``args`` (an ``AsyncGRPOConfig``) as TRL's own worker does. ``args.token_budget`` must be set: unset,
    the trainer asks a vLLM server for it. ``processing_class``: the trainer's tokenizer (default: the student's)."""
    if getattr(args, "token_budget", None) is None:
        raise ValueError(
            "args.token_budget: unset, AsyncGRPOTrainer asks a vLLM server for it; set it (0: fixed count)"
        )
    if processing_class is None:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(str(student))
    config = MixtureWorkerConfig(
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k or 0,
        min_p=args.min_p or 0.0,
        repetition_penalty=args.repetition_penalty,
        chat_template_kwargs=dict(args.chat_template_kwargs or {}),
        queue_maxsize=args.queue_maxsize,
    )
    transfer = MixtureWeightTransfer(rollouts, student)
    worker = MixtureRolloutWorker(
        rollouts, transfer, dataset=train_dataset, reward_funcs=reward_funcs, tokenizer=processing_class, config=config
    )
    return worker, transfer
