"""The on-policy distillation loop: sample from q with the current θ, train θ on the samples, push the new weights
into the theta engine (no restart), evaluate on held-out prompts; checkpoint every round.

Why not TRL's ``DistillationTrainer``: its loss runs the teacher model inside the trainer and reduces its chunked
divergence to one number, so per-token importance weights cannot enter it without rewriting ``_compute_loss``, and
its rollouts come from its own generation (transformers, or a vLLM server synchronised over NCCL), which a subclass
would replace wholesale. Here the teacher's signal is already in the records (``dense_logprobs``) and the rollouts
come from the dual engine, so the trainer is the few lines of :meth:`Distiller._train`; TRL's trainer is the outside
peer in ``examples/distill_experiment.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dual_sampling import start_engine_server_early
from dual_sampling.distill.config import DistillConfig
from dual_sampling.distill.evaluate import EvalSet, build_eval_set, evaluate, forced_logp
from dual_sampling.distill.loss import (
    ess_fraction,
    recorded_reverse_kl,
    recorded_teacher_logp,
    state_weights,
    top_k_forward_kl,
)
from dual_sampling.distill.mismatch import Mismatch, SamplerMismatchError, record_gaps
from dual_sampling.records import RequestRecord, SampleRecord
from dual_sampling.roster import THETA
from dual_sampling.run_output import fresh_dir, own_dir, remove_path, single_writer, write_no_follow
from dual_sampling.run_settings import changed_settings

__all__ = ["Distiller", "check_resume", "draw_round", "plot_run", "run_distillation"]

METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


def run_distillation(config: DistillConfig) -> list[dict[str, Any]]:
    """Run (or resume) ``config`` with a dual engine of its own; the per-round summaries."""
    check_resume(config)  # before anything loads: a refused resume costs nothing
    start_engine_server_early()  # the engines' fork server imports vLLM beside this process's imports
    from dual_sampling.api import OptimalSamplingDual

    with OptimalSamplingDual(config.source.teacher, config.source.theta, engine=config.engine, use_tqdm=False) as dual:
        return Distiller(config, dual).run()


def _identity(config: DistillConfig) -> dict[str, Any]:
    return json.loads(json.dumps(config.identity(), default=str))


def check_resume(config: DistillConfig) -> None:
    """With ``resume``, refuse settings other than those of the run in ``output`` (naming them)."""
    saved = Path(config.output) / "config.json"
    if not (config.resume and saved.exists()):
        return
    before, now = json.loads(saved.read_text()), _identity(config)
    changed = changed_settings(DistillConfig, before, now)
    if changed:
        raise ValueError(f"--resume with other settings than the run in {config.output}: {changed}")


def draw_round(
    r: int,
    draw: Callable[[list[int]], Sequence[RequestRecord]],
    order: Sequence[int],
    used: int,
    per_draw: int,
    budget: int,
    tokens_per_problem: int = 0,
) -> tuple[list[tuple[SampleRecord, RequestRecord]], int]:
    """Round ``r``'s complete samples, each with its request, in draw order, and the count of problems used after it.

    ``draw(picks)`` samples the training rows ``picks`` (one request each, in their order). The round walks ``order``
    from position ``used`` (wrapping), ``per_draw`` rows a draw: one draw, or with ``budget`` > 0 draws until the
    samples hold ``budget`` tokens, the last sample cut to meet it exactly. A problem counts as used only up to the
    last one of its draw that a sample was taken from; the draw's later problems are drawn again next, so runs whose
    samples differ in length (arms of one seed with other α) train on one sequence of problems.

    With ``tokens_per_problem`` (the most tokens one problem's samples can hold: max_tokens × n), a
    draw under a budget takes only the problems the remaining budget can still use, at most ``per_draw``: every one
    of them is then taken whole or cut, none discarded. The samples are those of full draws, since a sample's seed
    comes from its problem and round (``derive_seed``), not from the other problems of its draw; only the
    discarded tail is not sampled (at 512-token samples and a 1,024-token budget, 6 of 8).
    """
    taken: list[tuple[SampleRecord, RequestRecord]] = []
    tokens = 0
    while not taken or tokens < budget:
        size = per_draw
        if budget and tokens_per_problem:
            size = min(per_draw, -(-(budget - tokens) // tokens_per_problem))
        picks = [order[(used + i) % len(order)] for i in range(size)]
        requests = draw(picks)
        complete = [(i, s, req) for i, req in enumerate(requests) for s in req.samples if s.ok and s.token_ids]
        if not complete:
            raise RuntimeError(
                f"round {r}: no sample completed (errors: {[s.error for q in requests for s in q.samples]})"
            )
        last = -1  # the draw's last problem a sample was taken from
        for i, s, req in complete:
            if budget and tokens >= budget:
                break
            if budget and tokens + len(s.token_ids) > budget:
                s = s.first(budget - tokens)
            taken.append((s, req))
            tokens += len(s.token_ids)
            last = i
        used += last + 1
    return taken, used


class Distiller:
    """One run of :class:`DistillConfig` on an open dual engine (whose teacher is ``config.source.teacher``).

    The engine's theta weights are set to the run's student when the run starts or resumes, so one engine can serve
    several runs in turn (``examples/distill_experiment.py`` does). ``eval_set`` reuses a held-out set built before.
    """

    def __init__(self, config: DistillConfig, dual: Any, eval_set: EvalSet | None = None) -> None:
        from dual_sampling.prompts import Renderer

        self.config, self.dual = config, dual
        self.out = Path(config.output)
        self.vocab = dual.vocab
        self.eos_ids = sorted(dual.eos_token_ids)
        rows = [json.loads(line) for line in Path(config.prompts).read_text(encoding="utf-8").splitlines() if line]
        if len(rows) <= config.eval_prompts:
            raise ValueError(f"prompts has {len(rows)} rows: none left after eval_prompts={config.eval_prompts}")
        missing = [
            i
            for i, r in enumerate(rows)
            if not isinstance(r, dict) or not isinstance(r.get(config.source.prompt_field), str)
        ]
        if missing:
            raise ValueError(f"prompts row {missing[0]} has no text field {config.source.prompt_field!r}")
        roster = config.source.roster
        renderer = Renderer(dual.tokenizer, dict.fromkeys(roster.names), config.source.chat_template)
        fields = config.source.model_hint_fields
        self._render = lambda row, hinted: {
            name: renderer.prompt(user, None)
            for name, user in renderer.user_messages(
                row[config.source.prompt_field],
                {name: row.get(field) if hinted and field else None for name, field in fields.items()},
                row,
            ).items()
        }
        self._loss_teacher = config.loss_teacher_name
        self._dense_pair = (roster.position(self._loss_teacher), roster.position(THETA))
        self.train_rows = rows[: -config.eval_prompts]
        self.order = list(range(len(self.train_rows)))
        random.Random(config.sampling.seed).shuffle(self.order)
        held_out = rows[-config.eval_prompts :]
        self.device = torch.device(config.trainer_device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"trainer_device={config.trainer_device!r}: torch sees no CUDA device here")
        self.student = self._load(config.source.theta)
        self.optimizer = torch.optim.AdamW(
            self.student.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        self.teacher, self.eval_set = None, None
        if config.eval_every or config.loss == "reverse_full":
            self.teacher = self._load(config.source.folders[self._loss_teacher]).eval()
        if config.eval_every:
            saved_eval = self.out / "eval_set.json"
            if eval_set is None and config.resume and saved_eval.exists():  # the held-out set of the run resumed
                eval_set = EvalSet(**json.loads(saved_eval.read_text()))
            self.eval_set = eval_set or build_eval_set(
                self.teacher,
                [dual.tokenizer.encode(self._render(r, False)[THETA], add_special_tokens=False) for r in held_out],
                config.eval_max_tokens,
                self.eos_ids,
                self.vocab,
            )

    def _load(self, folder: str) -> Any:
        """A transformers model from ``folder``, float32, on the trainer's device."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.device)

    def _forward(self) -> contextlib.AbstractContextManager[None]:
        """The context of the trainer's forwards: bfloat16 autocast with ``trainer_dtype="bfloat16"``."""
        on = self.config.trainer_dtype == "bfloat16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()

    # ------------------------------------------------------------------ the run

    def run(self) -> list[dict[str, Any]]:
        """All rounds not yet done; returns every round's summary (round 0: the starting student)."""
        from tqdm.auto import tqdm

        cfg = self.config
        # One run writes an output at a time: two --resume runs appended to one metrics.jsonl and each deleted the
        # other's checkpoints.
        with single_writer(self.out, self.out.with_name(self.out.name + ".lock")):
            done = self._start()
            rows = self._metrics()
            bar = tqdm(total=cfg.rounds, initial=done, desc="distill", unit="round", file=sys.stderr)
            alpha_before = self.dual.alpha_settings  # an annealed budget is the run's: the engine gets its own back
            try:
                for r in range(done + 1, cfg.rounds + 1):
                    row = self._round(r, previous=rows[-1])
                    rows.append(row)
                    bar.update(1)
                    bar.write(_summary_line(row), file=sys.stderr)  # stdout is for results
            finally:
                bar.close()
                if self.dual.alpha_settings != alpha_before and self.dual.failure is None:
                    method, config = alpha_before
                    self.dual.update_alpha(method, **config)
            if cfg.plot and cfg.eval_every:  # the plot shows the held-out metrics
                plot_run(rows, self.out / "plot.png")
        return rows

    def _start(self) -> int:
        """Prepare ``output`` (fresh or resumed); the last round done. The engine gets the student's weights."""
        cfg = self.config
        identity = _identity(cfg)
        saved = self.out / "config.json"
        if cfg.resume and saved.exists():
            check_resume(cfg)
            done = self._last_checkpoint()
            # A round's metrics line is written before its checkpoint: lines past the last checkpoint are dropped
            # (those rounds run again), and a checkpoint always has its line.
            kept = [row for row in self._metrics() if row["round"] <= done]
            if kept and kept[-1]["round"] == done:
                if done > 0:
                    folder = self._checkpoint(done)
                    state = torch.load(folder / "trainer_state.pt", weights_only=True, map_location=self.device)
                    # Read on the CPU: load_state_dict copies onto the student's device (no second copy there).
                    loaded = type(self.student).from_pretrained(folder, dtype=torch.float32)
                    self.student.load_state_dict(loaded.state_dict())
                    self.optimizer.load_state_dict(state["optimizer"])
                    self.dual.update_theta(folder, version=f"round-{done}")
                else:
                    self.dual.update_theta(cfg.source.theta, version="round-0")
                write_no_follow(self.out / METRICS, "".join(json.dumps(row) + "\n" for row in kept))
                return done
            if done > 0:
                raise ValueError(f"{self.out}: metrics.jsonl has no line for round {done}, its last checkpoint")
            (self.out / METRICS).unlink(missing_ok=True)  # killed before round 0 was written: start afresh
        elif (self.out / METRICS).exists():
            raise FileExistsError(f"{self.out} holds a run already; pass --resume to continue it")
        self.out.mkdir(parents=True, exist_ok=True)
        write_no_follow(saved, json.dumps(identity, indent=1))
        if self.eval_set is not None:
            write_no_follow(self.out / "eval_set.json", json.dumps(dataclasses.asdict(self.eval_set)))
        self.dual.update_theta(cfg.source.theta, version="round-0")
        t0 = time.perf_counter()
        row = {"round": 0, "theta_version": "round-0", "tokens": 0, "prompts_used": 0, **self._evaluate()}
        row.update(eval_s=time.perf_counter() - t0, wall_s=0.0)
        self._append(row)
        return 0

    def _round(self, r: int, previous: dict[str, Any]) -> dict[str, Any]:
        """Round ``r`` after the round summarised by ``previous``; its summary, written before its checkpoint."""
        t0 = time.perf_counter()
        budget = self.config.kl_budget(r)
        if budget is not None:
            self.dual.update_alpha("trust_region", **{**self.config.engine.alpha_kwargs, "kl_budget": budget})
        # Older runs' rows lack prompts_used: one draw of prompts_per_round a round then.
        used = previous.get("prompts_used", (r - 1) * self.config.prompts_per_round)
        samples, prompt_ids, used = self._sample(r, used)
        t1 = time.perf_counter()
        train = self._train(r, samples, prompt_ids)
        t2 = time.perf_counter()
        version = self.dual.update_theta(self.student.state_dict(), version=f"round-{r}")
        t3 = time.perf_counter()
        every = self.config.eval_every
        held_out = self._evaluate() if every and (r % every == 0 or r == self.config.rounds) else {}
        t4 = time.perf_counter()
        row = {
            "round": r,
            "theta_version": version,
            "samples": len(samples),
            "prompts_used": used,
            "tokens": previous["tokens"] + sum(len(s.token_ids) for s in samples),
            **({} if budget is None else {"kl_budget": budget}),
            **train,
            **held_out,
            "sample_s": t1 - t0,
            "train_s": t2 - t1,
            "update_s": t3 - t2,
            "eval_s": t4 - t3,
        }
        row["wall_s"] = previous["wall_s"] + (time.perf_counter() - t0)
        self._append(row)  # before the checkpoint: a resume never meets a checkpoint without its line
        self._save(r)
        return row

    # ------------------------------------------------------------------ the parts of a round

    def _sample(self, r: int, used: int) -> tuple[list[SampleRecord], list[tuple[list[int], list[int]]], int]:
        """Round ``r``'s samples from q (complete ones only), each one's (teacher, theta) prompt ids, and the count of
        problems used after the round (``used`` before it): :func:`draw_round` over the seeded order."""
        cfg = self.config

        teachers = cfg.source.roster.teachers

        def draw(picks: list[int]) -> list[RequestRecord]:
            prompts = [self._render(self.train_rows[i], True) for i in picks]
            return self.dual.generate(
                [p[THETA] for p in prompts],
                teacher_prompts={name: [p[name] for p in prompts] for name in teachers},
                sampling=dataclasses.replace(cfg.sampling, seed=cfg.sampling.seed + r),
                prompt_keys=[str(i) for i in picks],
                use_tqdm=False,
            ).requests

        per_problem = cfg.sampling.max_tokens * cfg.sampling.n
        taken, used = draw_round(r, draw, self.order, used, cfg.prompts_per_round, cfg.tokens_per_round, per_problem)
        prompt_ids = [(self._teacher_ids(req), list(req.theta_prompt_token_ids)) for _, req in taken]
        return [s for s, _ in taken], prompt_ids, used

    def _teacher_ids(self, request: RequestRecord) -> list[int]:
        """The prompt ids of the loss's teacher in ``request``."""
        ids = request.teacher_prompt_token_ids
        return list(ids[self._loss_teacher] if isinstance(ids, dict) else ids)

    def _train(
        self, r: int, samples: list[SampleRecord], prompt_ids: list[tuple[list[int], list[int]]]
    ) -> dict[str, float]:
        """Round ``r``'s ``steps_per_round`` AdamW steps on equal shares of the samples; the round's loss, weight
        statistics and sampler–trainer mismatch (SamplerMismatchError above ``max_sampler_mismatch``, before any
        step)."""
        cfg = self.config
        student = self.student
        student.train()
        log_w = [
            torch.tensor(s.logp_theta, dtype=torch.float64) - torch.tensor(s.logq, dtype=torch.float64) for s in samples
        ]
        losses, used = [], []
        gaps: list[torch.Tensor] = []
        steps = min(cfg.steps_per_round, len(samples))
        for k in range(steps):
            batch = list(range(k, len(samples), steps))
            weights = state_weights([log_w[i] for i in batch], cfg.weighting, cfg.max_weight)
            used += weights
            tokens = sum(len(samples[i].token_ids) for i in batch)
            total = 0.0
            for i, c in zip(batch, weights):
                s, (teacher_prompt, prompt) = samples[i], prompt_ids[i]
                ids = torch.tensor([prompt + list(s.token_ids)], device=self.device)
                with self._forward():
                    logits = student(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(s.token_ids), : self.vocab]
                if k == 0:  # before any optimizer step this round: the θ that sampled (a spread-out share of samples)
                    gaps.append(record_gaps(logits, s.token_ids, s.logp_theta))
                kl = self._divergence(logits.float(), s, teacher_prompt)
                loss = (c.to(kl.device, kl.dtype) * kl).sum() / tokens
                loss.backward()
                total += float(loss.detach())
            if k == 0:
                mismatch = Mismatch.of(gaps)
                if not mismatch.max_abs <= cfg.max_sampler_mismatch:
                    raise SamplerMismatchError(
                        f"round {r}: the sampled tokens' log π_θ differ from the trained model's by up to "
                        f"{mismatch.max_abs:.3g} nats (mean {mismatch.mean_abs:.3g} over {mismatch.tokens} tokens), "
                        f"above max_sampler_mismatch={cfg.max_sampler_mismatch:g}: the theta engine did not sample "
                        "from the model being trained",
                        mismatch,
                    )
            torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(total)
        alphas = [a for s in samples for a in s.total_alpha]  # with several teachers, their total weight
        return {
            "loss": statistics.fmean(losses),
            "mean_alpha": statistics.fmean(alphas),
            "ess_token": statistics.fmean(ess_fraction(w) for w in log_w),
            "ess_sequence": ess_fraction(torch.stack([w.sum() for w in log_w])),
            "ess_used": ess_fraction(torch.log(torch.cat(used))),
            "mean_log_w_per_token": float(torch.cat(log_w).mean()),
            "sampler_mismatch_mean": mismatch.mean_abs,
            "sampler_mismatch_max": mismatch.max_abs,
        }

    def _divergence(self, logits: torch.Tensor, s: SampleRecord, teacher_prompt: list[int]) -> torch.Tensor:
        """``config.loss`` at each of the sample's positions ``[n]``, from θ's ``logits`` and the sample's dense records
        (``reverse_full``: the teacher's rows, from a forward of the trainer's teacher on its prompt and the tokens)."""
        if self.config.loss == "reverse_full":
            with self._forward():
                teacher_logp = forced_logp(self.teacher, teacher_prompt, s.token_ids, self.vocab).float()
            logp = torch.log_softmax(logits.float(), -1)
            return (logp.exp() * (logp - teacher_logp)).sum(-1)
        on_device = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(logits.device)
        dense_ids, dense_logp, dense_other_logp = s.dense_pair(*self._dense_pair)  # the loss's teacher and θ
        if self.config.loss == "reverse":
            ids, teacher_logp = recorded_teacher_logp(*map(on_device, (dense_ids, dense_logp, dense_other_logp)))
            return recorded_reverse_kl(logits, ids, teacher_logp)
        return top_k_forward_kl(logits, on_device(dense_ids[:, 0].astype("int64")), on_device(dense_logp[:, 0]))

    def _evaluate(self) -> dict[str, float]:
        if self.eval_set is None:
            return {}
        return evaluate(self.student, self.teacher, self.eval_set, self.vocab, self.config.eval_max_tokens)

    # ------------------------------------------------------------------ files

    def _checkpoint(self, r: int) -> Path:
        return self.out / CHECKPOINTS / f"round-{r}"

    def _last_checkpoint(self) -> int:
        """The last round whose checkpoint is complete (0 if none)."""
        done = [
            int(p.name.split("-")[1])
            for p in (self.out / CHECKPOINTS).glob("round-*")
            if p.name.split("-")[1].isdigit() and (p / "trainer_state.pt").exists()
        ]
        return max(done, default=0)

    def _save(self, r: int) -> None:
        """Round ``r``'s student, tokenizer and optimizer state, written whole before the previous one goes: a kill at
        any moment leaves one complete checkpoint (its trainer_state.pt is written last)."""
        final = self._checkpoint(r)
        own_dir(final.parent)
        partial = fresh_dir(final.with_name(final.name + ".partial"))  # a planted link is removed, not followed
        self.student.save_pretrained(partial)
        from transformers import AutoTokenizer  # as its folder defines it: the sampler's is vLLM's cached subclass

        AutoTokenizer.from_pretrained(self.dual.config.tokenizer_folder).save_pretrained(partial)
        torch.save({"optimizer": self.optimizer.state_dict(), "round": r}, partial / "trainer_state.pt")
        remove_path(final)
        os.replace(partial, final)
        for old in (self.out / CHECKPOINTS).glob("round-*"):
            if old != final:
                remove_path(old)

    def _metrics(self) -> list[dict[str, Any]]:
        path = self.out / METRICS
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def _append(self, row: dict[str, Any]) -> None:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"round {row['round']}: non-finite {bad}; the run stops before writing them")
        write_no_follow(self.out / METRICS, json.dumps(row) + "\n", append=True)


def _summary_line(row: dict[str, Any]) -> str:
    held_out = ""
    if "kl_teacher_student" in row:  # a round the held-out metrics were computed for
        held_out = (
            f"KL(t‖θ) {row['kl_teacher_student']:.4f}  KL(θ‖t) {row['kl_student_teacher']:.4f}  "
            f"teacher logp/token {row['teacher_logp_of_greedy']:.3f}  repetition {row['repetition_rate']:.3f}  "
        )
    return (
        f"round {row['round']}: {held_out}tokens {row['tokens']}  "
        f"loss {row['loss']:.4f}  α {row['mean_alpha']:.3f}  ESS/n {row['ess_sequence']:.2f}  "
        f"|Δlog π_θ| max {row['sampler_mismatch_max']:.2g}  "
        f"sample {row['sample_s']:.1f}s train {row['train_s']:.1f}s update {row['update_s']:.2f}s"
    )


PLOTTED = {
    "kl_teacher_student": "KL(π_t ‖ π_θ) per token",
    "kl_student_teacher": "KL(π_θ ‖ π_t) per token",
    "teacher_logp_of_greedy": "teacher log-prob / token of θ's greedy answers",
    "repetition_rate": "repeated 4-grams in θ's greedy answers",
}


def plot_run(rows: list[dict[str, Any]], path: Path) -> None:
    """The held-out metrics against round (top) and wall time (bottom), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(PLOTTED), figsize=(4 * len(PLOTTED), 6.5), squeeze=False)
    for j, (key, title) in enumerate(PLOTTED.items()):
        for i, x in enumerate(("round", "wall_s")):
            ax = axes[i][j]
            shown = [row for row in rows if key in row]  # rounds without held-out metrics are left out
            ax.plot([row[x] for row in shown], [row[key] for row in shown], marker="o")
            ax.set_xlabel("round" if x == "round" else "wall time (s)")
            ax.set_title(title, fontsize=9)
    fig.tight_layout()
    from dual_sampling.run_output import open_no_follow

    with open_no_follow(path, "wb") as f:  # a link planted at plot.png is refused, never written through
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
