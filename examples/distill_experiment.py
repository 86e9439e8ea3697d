"""The pre-registered experiments of docs/distillation.md: are the mixture's samples better states for on-policy
distillation than either model's own? (``--design first``), and does trust-region blending as published help?
(``--design second``, the default).

The first design's four arms train the same student from the same start, differing only in the distribution the
training states are sampled from:

  student        α = 0: the student's own samples (on-policy distillation as published)
  teacher        α = 1: the teacher's samples
  kl_symmetry    α per token, dual-sampling's default
  trust_region   α per token, the largest with KL(q_α‖π_θ) ≤ ε (trust-region behaviour blending's rule), ε falling
                 linearly by a quarter of its start a round: 0.8, 0.6, 0.4, 0.2 nats over the four rounds. It never
                 reaches 0, so this arm never returns to the student's own samples as the published method does;
                 its verdict is on this schedule only. ε chosen by --pilot, before the run

The second design (``SECOND``) runs two of them, student and trust_region, with ε annealed to 0 over the first half of
the rounds and the student's own samples after (the published schedule), on 16 paired seeds, and decides by
non-inferiority on the own KL and superiority on the human solutions' NLL (``compare.trust_region_helps``); its
pilot (``pilot_second``) fixes max_tokens and the rounds by rules written before it ran.

Held equal across arms: the loss (the per-prefix reverse KL over the whole vocabulary), no importance
weighting, the learning rate, the optimizer steps, and the generated tokens of every round (draws continue until the
budget is met; the last sample is cut). Seeds are paired: a seed fixes the prompt order and the sampling seeds of
every arm, and each arm trains on that order's problems in sequence (a problem counts as used once a sample of it is
trained on). The run of docs/distillation.json predates that accounting: a draw of 8 problems counted all 8 even when
fewer samples were taken, so its arms of one seed shared only part of their problems (the doc gives the counts).

The primary metric, fixed before the run: the final student's KL(π_θ‖π_t) per token on its own samples (48 held-out
problems, 2 samples each at temperature 1, at most 128 tokens; exact sums over the vocabulary in float64, transformers
forwards). The decision rule and the secondary metrics are in docs/distillation.md ("Design").

Each (arm, seed) cell resumes on its own: an interrupted run loses at most the round in progress, and a finished cell
(its cell.json) is never run again. One dual engine serves every cell (its alpha method is set per cell).

    python examples/distill_experiment.py --pilot --output bench-out/distill-2     # the design's pilot
    python examples/distill_experiment.py --output bench-out/distill-2 --archive docs/distillation_second
                                                                                   # make experiment-distill
    python examples/distill_experiment.py --report --output bench-out/distill-2    # analysis of the finished cells
    python examples/distill_experiment.py --quick --output /tmp/dx                 # the tiny pair, a smoke run
    python examples/distill_experiment.py --design first --output bench-out/distill   # the first experiment

Writes, under --output: design.json, references.json (the teacher's samples and the human solutions), one folder per
cell with its metrics.jsonl and cell.json, the final student of the first seed of every arm, and (--report)
results.json, distillation.png and the Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dual_sampling import ModelsAndPrompts, models
from dual_sampling.distill import DistillConfig, Distiller
from dual_sampling.distill.compare import bootstrap_interval, sign_flip_p, trust_region_helps
from dual_sampling.distill.evaluate import continuation_logp, distinct_n, divergence_sums, repetition_rate, sample
from dual_sampling.options import EngineOptions, SamplingOptions
from dual_sampling.run_output import remove_path, write_no_follow
from dual_sampling.testing import tiny_models

DATA = Path(__file__).resolve().parent / "data" / "gsm8k" / "subset.jsonl"

PURE_ARMS = ("student", "teacher")
MIXTURE_ARMS = ("kl_symmetry", "trust_region")
ARMS = (*PURE_ARMS, *MIXTURE_ARMS)

PRIMARY = "own_kl_student_teacher"
"""The primary metric: KL(π_θ‖π_t) per token on the student's own held-out samples (lower is better)."""


@dataclass(frozen=True)
class Design:
    """The experiment's settings, written to design.json before the first cell; a resumed run must match them."""

    keep_layers: int = 20
    """Layers of SmolLM2-135M-Instruct's 30 that the student keeps (a start far from the teacher)."""
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    """Paired seeds: each fixes the prompt order and the sampling seeds of every arm (and, since the loop counts only
    the problems trained on, the problems every arm trains on)."""
    rounds: int = 4
    """Sample-train-update rounds per cell."""
    tokens_per_round: int = 1024
    """Generated tokens trained on per round, equal in every arm."""
    steps_per_round: int = 4
    """AdamW steps per round."""
    learning_rate: float = 5e-5
    """AdamW learning rate (constant)."""
    loss_top_k: int = 64
    """Each model's top k recorded per token with both log-probabilities (the records' dense signal; the
    ``reverse_full`` loss reads the teacher's rows instead)."""
    max_tokens: int = 128
    """Longest sample, training and held out."""
    kl_budget: float = 0.8
    """trust_region's starting ε (nats), falling linearly to ε/rounds in the last round (0.2 nats: never 0, the
    warm-up being as long as the run; ``DistillConfig.kl_budget_warmup_rounds``). Chosen by --pilot before the run, by
    a rule fixed before it: the budget of PILOT_BUDGETS whose mean α on the starting student's first samples is
    closest to kl_symmetry's (on the 20-layer student: 0.489 at ε = 0.8 against 0.500; 0.357 at 0.4, 0.672 at 1.6),
    so that both mixture arms start from about the same blend and differ in how they place and anneal it."""
    eval_prompts: int = 48
    """Held-out problems: the data file's last rows."""
    eval_samples: int = 2
    """The student's samples per held-out problem (the primary metric)."""
    quick: bool = False
    """The tiny random pair and short samples: a smoke run of the machinery, not evidence."""
    arms: tuple[str, ...] = ARMS
    """The arms run, in this order within each seed."""
    anneal_rounds: int = 0
    """trust_region: the rounds over which ε falls linearly to 0, after which it samples at ε = 0, that is from the
    student alone (α = 0), as published; 0: over all the rounds, ending at ε₀/rounds, never 0 (the first run)."""
    rule: str = "beats_both"
    """The decision rule: "beats_both" (the first experiment: a mixture arm beats both pure arms on the primary
    metric) or "helps" (the second: non-inferiority on the own KL within ``margin`` and superiority on the human
    solutions' NLL, ``compare.trust_region_helps``)."""
    margin: float = 0.05
    """The non-inferiority margin of the "helps" rule (nats per token), fixed before the run."""
    eval_batch_size: int = 0
    """Held-out samples per transformers ``generate`` call (``evaluate.sample``); 0: all of a set in one batch. The
    batching picks which draw each sample is, not its distribution."""


FIRST = Design()
"""The first experiment (docs/distillation.json), as it ran."""

SECOND = Design(
    arms=("student", "trust_region"),
    seeds=tuple(range(16)),
    rounds=10,
    anneal_rounds=5,
    max_tokens=512,
    rule="helps",
    eval_batch_size=16,
)
"""The second experiment (docs/distillation.md, "The second experiment"): trust-region blending as published against
α = 0, 16 paired seeds; rounds and max_tokens by the pilot's rules (``--design second --pilot``, in
docs/distillation_second.json): no cap up to 512 lets 90 % of the teacher's answers end (54 % end within 512), so
512; the α = 0 loss is within 10 % of its 16-round end at round 10. Held-out samples in batches of 16: the amendment
of 2026-11-28, made before the run that is reported (docs/distillation.md, "Amendment")."""

DESIGNS = {"first": FIRST, "second": SECOND}


def base_config(design: Design, out: Path, teacher: Path, theta: Path, prompts: Path) -> DistillConfig:
    return DistillConfig(
        prompts=str(prompts),
        output=str(out),
        source=ModelsAndPrompts(str(teacher), str(theta), prompt_field="question", chat_template=not design.quick),
        eval_prompts=design.eval_prompts,
        eval_every=0,  # this experiment evaluates each final student itself
        rounds=design.rounds,
        prompts_per_round=8,
        tokens_per_round=design.tokens_per_round,
        steps_per_round=design.steps_per_round,
        learning_rate=design.learning_rate,
        loss="reverse_full",
        weighting="none",
        loss_top_k=design.loss_top_k,
        max_sampler_mismatch=0.05,
        resume=True,
        plot=False,
        sampling=SamplingOptions(max_tokens=design.max_tokens, temperature=1.0),
        engine=EngineOptions(
            max_num_seqs=16,
            max_model_len=1024,
            kv_cache_memory_bytes=1 << 30,
            max_dense_logprobs=design.loss_top_k,
            use_tqdm=False,
        ),
    )


def arm_alpha(arm: str, design: Design) -> tuple[str, dict[str, Any]]:
    """The alpha method and configuration an arm samples with (trust_region: its starting budget)."""
    return {
        "student": ("fixed", {"alpha": 0.0}),
        "teacher": ("fixed", {"alpha": 1.0}),
        "kl_symmetry": ("kl_symmetry", {}),
        "trust_region": ("trust_region", {"kl_budget": design.kl_budget}),
    }[arm]


# ---------------------------------------------------------------------------------------------------- held-out sets


def strip_calculator(answer: str) -> str:
    """A GSM8K solution without its calculator annotations (``<<48/2=24>>``), as a person writes it."""
    return re.sub(r"<<[^>]*>>", "", answer)


def theta_prompts(tokenizer: Any, rows: list[dict], design: Design) -> list[str]:
    """The problems as the student sees them (no hint; chat template but for --quick), as the Distiller renders them."""
    from dual_sampling.prompts import Renderer

    renderer = Renderer(tokenizer, {"teacher": None, "theta": None}, not design.quick)
    return [renderer.prompt(renderer.user_messages(r["question"], {}, r)["theta"], None) for r in rows]


def final_answer(text: str, last_number: bool = False) -> str | None:
    """A GSM8K answer as a plain number string ("1,200" → "1200", "3.50" → "3.5"): the number after "####", or with
    ``last_number`` the last number in ``text`` (how a free-form answer is read); None where there is none."""
    if not last_number:
        text = text.split("####")[-1] if "####" in text else ""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "")
    return value.rstrip("0").rstrip(".") if "." in value else value


class HeldOut:
    """The held-out problems rendered as the student sees them, and the fixed sequences scored for every student:
    the teacher's samples at temperature 1 (drawn once) and the human solutions, with the teacher's rows on them
    computed once. Every sample here is drawn by transformers (``evaluate.sample``), independently of the engine."""

    def __init__(self, tokenizer: Any, eos_ids: list[int], rows: list[dict], design: Design, out: Path, teacher: Any):
        self.design, self.eos_ids, self.teacher, self.tokenizer = design, eos_ids, teacher, tokenizer
        self.vocab = len(tokenizer)
        self.answers = [final_answer(r.get("answer", "")) for r in rows]
        self.prompt_ids = [
            tokenizer.encode(p, add_special_tokens=False) for p in theta_prompts(tokenizer, rows, design)
        ]
        human = [
            [*tokenizer.encode(strip_calculator(r.get("answer", "")), add_special_tokens=False), eos_ids[0]][
                : design.max_tokens
            ]
            for r in rows
        ]
        saved = out / "references.json"
        if saved.exists():
            teacher_samples = json.loads(saved.read_text())["teacher_samples"]
        else:
            teacher_samples = sample(
                teacher, self.prompt_ids, 1, design.max_tokens, eos_ids, 1_000_003, design.eval_batch_size
            )
            write_no_follow(saved, json.dumps({"teacher_samples": teacher_samples, "human": human}))
        self.fixed = {"teacher_samples": [group[0] for group in teacher_samples], "human": human}
        # The teacher's rows on the fixed sequences, once for every student (float32: 1e-7 relative).
        self.teacher_fixed = [
            [r.float() for r in continuation_logp(teacher, p, [t, h], self.vocab)]
            for p, t, h in zip(self.prompt_ids, self.fixed["teacher_samples"], human)
        ]

    def score(self, student: Any, seed: int) -> dict[str, Any]:
        """Every metric of one student (its own samples drawn with ``seed``): per-token figures pooled over tokens,
        per-sequence ones averaged. Each prompt's forward runs once per model; its continuations in one batch."""
        import torch

        n = self.design.eval_samples
        own = sample(
            student, self.prompt_ids, n, self.design.max_tokens, self.eos_ids, seed, self.design.eval_batch_size
        )
        sums: dict[str, list[dict[str, float]]] = {"own": [], "teacher_samples": [], "human": []}
        human_nll: list[float] = []
        was_training = student.training
        student.eval()
        try:
            for i, prompt in enumerate(self.prompt_ids):
                fixed = [self.fixed["teacher_samples"][i], self.fixed["human"][i]]
                s_rows = continuation_logp(student, prompt, [*own[i], *fixed], self.vocab)
                t_rows = continuation_logp(self.teacher, prompt, own[i], self.vocab) + self.teacher_fixed[i]
                for j, (ls, lt) in enumerate(zip(s_rows, t_rows)):
                    name = "own" if j < n else ("teacher_samples", "human")[j - n]
                    sums[name].append(divergence_sums(ls, lt))
                human = torch.tensor(self.fixed["human"][i])
                human_nll.append(-float(s_rows[-1].gather(-1, human[:, None]).sum()))
        finally:
            student.train(was_training)
        metrics: dict[str, Any] = {}
        for name, rows in sums.items():
            tokens = sum(r["tokens"] for r in rows)
            for key in ("kl_student_teacher", "kl_teacher_student"):
                metrics[f"{name}_{key}"] = sum(r[key] for r in rows) / tokens
        # The student's NLL per token of the human solutions (no hint), pooled over their tokens.
        metrics["human_nll"] = sum(human_nll) / sum(len(h) for h in self.fixed["human"])
        rows = sums["own"]
        metrics["own_kl_student_teacher_per_sequence"] = statistics.fmean(r["kl_student_teacher"] for r in rows)
        metrics["own_student_entropy"] = sum(r["student_entropy"] for r in rows) / sum(r["tokens"] for r in rows)
        # The teacher's entropy on the same states: the scale the KLs are read against.
        metrics["own_teacher_entropy"] = sum(r["teacher_entropy"] for r in rows) / sum(r["tokens"] for r in rows)
        metrics["own_tokens"] = sum(r["tokens"] for r in rows)
        own_pairs = [(p, s) for p, group in zip(self.prompt_ids, own) for s in group]
        texts = [s for _, s in own_pairs]
        # An answer ended when its last token is an EOS id (the sampler stops there); one cut at max_tokens did not.
        ended = [bool(s) and s[-1] in self.eos_ids for s in texts]
        metrics["own_end_rate"] = statistics.fmean(ended)
        # The share of own samples whose last number is the problem's answer (GSM8K's "#### N"): small for students
        # this size, recorded as the issue asks, not decided on.
        answers = [self.answers[i] for i, group in enumerate(own) for _ in group]
        texts_decoded = [self.tokenizer.decode(s, skip_special_tokens=True) for _, s in own_pairs]
        metrics["own_accuracy"] = statistics.fmean(
            a is not None and final_answer(t, last_number=True) == a for t, a in zip(texts_decoded, answers)
        )
        metrics["own_per_sequence"] = [
            {"tokens": r["tokens"], "kl_student_teacher": r["kl_student_teacher"], "ended": e}
            for r, e in zip(rows, ended)
        ]
        metrics["own_length"] = statistics.fmean(map(len, texts))
        metrics["own_repetition"] = statistics.fmean(map(repetition_rate, texts))
        metrics["own_distinct_2"] = statistics.fmean(d for d in map(distinct_n, texts) if d == d)
        return metrics


# ---------------------------------------------------------------------------------------------------- cells


def run_cell(
    arm: str, seed: int, design: Design, base: DistillConfig, dual: Any, held: HeldOut, first: bool
) -> dict[str, Any]:
    """Train one (arm, seed) cell to its last round (resuming), evaluate its final student, write cell.json."""
    folder = Path(base.output) / arm / f"seed-{seed}"
    done = folder / "cell.json"
    if done.exists():
        return json.loads(done.read_text())
    method, alpha_config = arm_alpha(arm, design)
    cfg = dataclasses.replace(
        base,
        output=str(folder),
        engine=dataclasses.replace(base.engine, alpha_method=method, alpha_config=alpha_config),
        sampling=dataclasses.replace(base.sampling, seed=seed),
        kl_budget_warmup_rounds=(design.anneal_rounds or design.rounds) if arm == "trust_region" else 0,
    )
    dual.update_alpha(method, **alpha_config)
    t0 = time.perf_counter()
    distiller = Distiller(cfg, dual)
    rounds = distiller.run()
    t1 = time.perf_counter()
    metrics = held.score(distiller.student, seed=2_000_003 + seed)
    cell = {
        "arm": arm,
        "seed": seed,
        **{k: v for k, v in metrics.items() if k != "own_per_sequence"},
        "tokens_per_round": [r["tokens"] - p["tokens"] for p, r in itertools.pairwise(rounds)],
        "mean_alpha_per_round": [r["mean_alpha"] for r in rounds[1:]],
        "kl_budget_per_round": [r.get("kl_budget") for r in rounds[1:]],
        # The records' Monte Carlo estimate of KL(q‖π_θ) per token: the mean of log q − log π_θ at the sampled tokens.
        "kl_q_theta_per_round": [-r["mean_log_w_per_token"] for r in rounds[1:]],
        "loss_per_round": [r["loss"] for r in rounds[1:]],
        "sampler_mismatch_max": max(r["sampler_mismatch_max"] for r in rounds[1:]),
        "train_wall_s": t1 - t0,  # this process's share (a resumed cell counts its last part only)
        "rounds_wall_s": rounds[-1]["wall_s"],
        "eval_wall_s": time.perf_counter() - t1,
        "per_sequence": metrics["own_per_sequence"],
        "rounds": rounds,
    }
    write_no_follow(done, json.dumps(cell))
    if not first:  # the first seed's final student is kept for others to evaluate; the rest would fill the disk
        remove_path(folder / "checkpoints")
    return cell


def start_cell(base: DistillConfig, held: HeldOut) -> dict[str, Any]:
    """The starting student's metrics (with seed 0's held-out samples), written once to start.json."""
    import torch
    from transformers import AutoModelForCausalLM

    done = Path(base.output) / "start.json"
    if done.exists():
        return json.loads(done.read_text())
    student = AutoModelForCausalLM.from_pretrained(base.source.theta, dtype=torch.float32)
    start = {k: v for k, v in held.score(student, seed=2_000_003).items() if k != "own_per_sequence"}
    write_no_follow(done, json.dumps(start))
    return start


PILOT_BUDGETS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
"""The starting budgets ε (nats) the pilot tries."""


def pilot(design: Design, base: DistillConfig, dual: Any, rows: list[dict], out: Path) -> None:
    """Mean α of the starting student's first round at several budgets, beside kl_symmetry's: the choice of ε."""
    prompts = theta_prompts(dual.tokenizer, rows[:16], design)
    dual.update_theta(base.source.theta, version="start")
    found = {}
    for method, config in [("kl_symmetry", {})] + [("trust_region", {"kl_budget": e}) for e in PILOT_BUDGETS]:
        dual.update_alpha(method, **config)
        out_ = dual.generate(prompts, max_tokens=design.max_tokens, temperature=1.0, seed=77, use_tqdm=False)
        alphas = [a for req in out_.requests for s in req.samples for a in s.alpha]
        tokens = sum(len(s.token_ids) for req in out_.requests for s in req.samples)
        label = method if not config else f"trust_region ε={config['kl_budget']}"
        found[label] = {"mean_alpha": statistics.fmean(alphas), "tokens": tokens}
        print(f"{label}: mean α {found[label]['mean_alpha']:.3f} over {tokens} tokens", flush=True)
    write_no_follow(out / "pilot.json", json.dumps(found, indent=1))


PILOT_SEED = 1000
"""The second pilot's seed: its prompt order and samples are none of the experiment's (seeds 0–15)."""
PILOT_LENGTH_CAP = 512
"""The longest teacher answer the second pilot lets run (tokens)."""
PILOT_ROUNDS = 16
"""Rounds of the second pilot's α = 0 cell."""


def pilot_second(design: Design, base: DistillConfig, dual: Any, rows: list[dict], out: Path) -> dict[str, Any]:
    """The second experiment's pilot, on training problems only, by rules fixed before it ran (docs/distillation.md):

    1. ``max_tokens``: the teacher (α = 1) answers the first 48 training problems at temperature 1, up to
       PILOT_LENGTH_CAP tokens; the smallest multiple of 64 within which at least 90 % of its answers end.
    2. ``rounds``: an α = 0 cell (seed PILOT_SEED, that max_tokens, PILOT_ROUNDS rounds, the design's tokens, steps and
       rate); with m_r the mean training loss of rounds r−1 and r, the smallest even r ≥ 4 with
       m_r ≤ 1.1·m_PILOT_ROUNDS: where the loss is within 10 % of where the pilot ends. ``anneal_rounds`` is half.
    """
    found: dict[str, Any] = {}
    prompts = theta_prompts(dual.tokenizer, rows[:48], design)
    dual.update_theta(base.source.theta, version="pilot-start")
    dual.update_alpha("fixed", alpha=1.0)
    t0 = time.perf_counter()
    answers = dual.generate(prompts, max_tokens=PILOT_LENGTH_CAP, temperature=1.0, seed=PILOT_SEED, use_tqdm=False)
    lengths = [len(s.token_ids) for req in answers.requests for s in req.samples]
    ended = [s.finish_reason == "stop" for req in answers.requests for s in req.samples]
    caps = list(range(64, PILOT_LENGTH_CAP + 1, 64))
    end_rate = {cap: statistics.fmean(e and n <= cap for e, n in zip(ended, lengths)) for cap in caps}
    max_tokens = next((cap for cap in caps if end_rate[cap] >= 0.9), PILOT_LENGTH_CAP)
    found["teacher_lengths"] = {"lengths": lengths, "ended": ended, "end_rate_within": end_rate, "wall_s": 0.0}
    found["teacher_lengths"]["wall_s"] = time.perf_counter() - t0
    found["max_tokens"] = max_tokens
    print(f"teacher answers end within {max_tokens} tokens at rate {end_rate[max_tokens]:.3f}", flush=True)
    write_no_follow(out / "pilot.json", json.dumps(found, indent=1))

    cfg = dataclasses.replace(
        base,
        output=str(out / "pilot-student"),
        rounds=PILOT_ROUNDS,
        engine=dataclasses.replace(base.engine, alpha_method="fixed", alpha_config={"alpha": 0.0}),
        sampling=dataclasses.replace(base.sampling, max_tokens=max_tokens, seed=PILOT_SEED),
    )
    dual.update_alpha("fixed", alpha=0.0)
    rounds = Distiller(cfg, dual).run()[1:]
    losses = [r["loss"] for r in rounds]
    smooth = {r: (losses[r - 2] + losses[r - 1]) / 2 for r in range(2, PILOT_ROUNDS + 1)}
    chosen = next(r for r in range(4, PILOT_ROUNDS + 1, 2) if smooth[r] <= 1.1 * smooth[PILOT_ROUNDS])
    found["student_cell"] = {
        "loss_per_round": losses,
        "smoothed_loss": smooth,
        "round_wall_s": [r["sample_s"] + r["train_s"] + r["update_s"] for r in rounds],
        "samples_per_round": [r["samples"] for r in rounds],
    }
    found["rounds"], found["anneal_rounds"] = chosen, chosen // 2
    print(f"rounds {chosen} (loss {smooth[chosen]:.3f} against {smooth[PILOT_ROUNDS]:.3f} at {PILOT_ROUNDS})")
    write_no_follow(out / "pilot.json", json.dumps(found, indent=1))
    return found


# ---------------------------------------------------------------------------------------------------- analysis

SECONDARY = [
    "own_kl_student_teacher_per_sequence",
    "own_kl_teacher_student",
    "teacher_samples_kl_student_teacher",
    "teacher_samples_kl_teacher_student",
    "human_kl_student_teacher",
    "human_kl_teacher_student",
    "own_repetition",
    "own_distinct_2",
    "own_length",
    "own_student_entropy",
    "own_teacher_entropy",
    "own_end_rate",
    "human_nll",
    "own_accuracy",
]
"""The secondary metrics (for the second experiment, human_nll is its second primary); the last four are saved by
cells run after docs/distillation.json was (its cells lack them)."""


def analyse(cells: list[dict[str, Any]], design: dict[str, Any]) -> dict[str, Any]:
    """Per arm: each metric's median and range over seeds; then the design's rule on the seeds every arm finished:
    "beats_both" (per mixture arm, the rule on the primary metric against each pure arm, paired by seed; lower is
    better, so the difference is pure − mixture) or "helps" (``compare.trust_region_helps``)."""
    arms = design.get("arms", ARMS)
    by = {(c["arm"], c["seed"]): c for c in cells}
    complete = [s for s in design["seeds"] if all((a, s) in by for a in arms)]
    table: dict[str, Any] = {}
    for arm in arms:
        table[arm] = {}
        for key in [PRIMARY, *SECONDARY]:
            values = [by[(arm, s)][key] for s in complete if key in by[(arm, s)]]
            if values and len(values) == len(complete):  # a metric older cells lack is not summarised from a part
                table[arm][key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    if design.get("rule", "beats_both") == "helps":
        if not complete:
            return {"seeds_complete": complete, "summary": table, "verdicts": {}}
        values = {key: {arm: [by[(arm, s)][key] for s in complete] for arm in arms} for key in (PRIMARY, "human_nll")}
        helps = trust_region_helps(values[PRIMARY], values["human_nll"], design["margin"])
        return {"seeds_complete": complete, "summary": table, "verdicts": {"trust_region": helps}}
    verdicts: dict[str, Any] = {}
    for mix in MIXTURE_ARMS:
        against = {}
        for pure in PURE_ARMS:
            d = [by[(pure, s)][PRIMARY] - by[(mix, s)][PRIMARY] for s in complete]
            if not d:
                continue
            lo, hi = bootstrap_interval(d)
            p = sign_flip_p(d)
            against[pure] = {
                "differences": d,
                "mean": statistics.fmean(d),
                "p_one_sided": p,
                "bootstrap_95": [lo, hi],
                "beats": p < 0.05 and lo > 0,
            }
        verdicts[mix] = {"against": against, "wins": bool(against) and all(v["beats"] for v in against.values())}
    return {"seeds_complete": complete, "summary": table, "verdicts": verdicts}


def plot(cells: list[dict[str, Any]], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [PRIMARY, *SECONDARY]
    cols = 4
    rows_ = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.2 * rows_), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, arm in enumerate(arms):
            values = [c[key] for c in cells if c["arm"] == arm and key in c]
            ax.scatter([i] * len(values), values, s=14, alpha=0.7)
            if values:
                ax.hlines(statistics.median(values), i - 0.3, i + 0.3, color="black")
        ax.set_xticks(range(len(arms)), arms, fontsize=7)
        ax.set_title(key + (" (primary)" if key == PRIMARY else ""), fontsize=8)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown_table(result: dict[str, Any], start: dict[str, Any] | None) -> str:
    keys = [PRIMARY, "own_kl_teacher_student", "teacher_samples_kl_student_teacher", "human_kl_student_teacher"]
    keys += ["own_repetition", "own_distinct_2", "own_length", "own_student_entropy"]
    if "helps" in str(result["verdicts"]):  # the second experiment's own figures
        keys = [PRIMARY, "human_nll", "own_end_rate", "own_teacher_entropy", "own_accuracy", "own_length"]
    head = "| arm | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys) + "\n"
    lines = []
    if start:
        lines.append("| start | " + " | ".join(f"{start[k]:.3f}" for k in keys) + " |")
    for arm, row in result["summary"].items():
        cells = [f"{row[k]['median']:.3f} ({row[k]['min']:.3f}–{row[k]['max']:.3f})" if k in row else "–" for k in keys]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    verdict = []
    for mix, v in result["verdicts"].items():
        if "helps" in v:
            for name, test in (
                ("non-inferiority, own KL", "non_inferiority_own_kl"),
                ("superiority, human NLL", "superiority_human_nll"),
            ):
                a = v[test]
                lo, hi = a["bootstrap_95"]
                verdict.append(
                    f"- {name}: mean {a['mean']:+.4f} nats/token, one-sided p = {a['p_one_sided']:.5f}, bootstrap 95 % "
                    f"[{lo:+.4f}, {hi:+.4f}] → {'passes' if a['passes'] else 'fails'}"
                )
            verdict.append(f"- **{mix}: {'helps' if v['helps'] else 'does not help'}** by the rule.")
            continue
        for pure, a in v["against"].items():
            verdict.append(
                f"- {mix} vs {pure}: mean difference {a['mean']:+.4f} nats/token (pure − mixture), one-sided p = "
                f"{a['p_one_sided']:.4f}, bootstrap 95 % [{a['bootstrap_95'][0]:+.4f}, {a['bootstrap_95'][1]:+.4f}]"
                f" → {'beats' if a['beats'] else 'does not beat'}"
            )
        verdict.append(f"- **{mix}: {'wins' if v['wins'] else 'does not win'}** by the rule.")
    return head + "\n".join(lines) + "\n\n" + "\n".join(verdict)


def teacher_end_rate(references: dict[str, Any], max_tokens: int) -> float:
    """The share of the teacher's held-out samples (``references.json``) that ended within ``max_tokens``. The
    sampler stops early only at an EOS id, so a sample shorter than the cap ended; one exactly at the cap counts as
    cut, even where its last token is an EOS id (the file does not name the EOS ids)."""
    return statistics.fmean(len(group[0]) < max_tokens for group in references["teacher_samples"])


def report(out: Path) -> dict[str, Any]:
    design = json.loads((out / "design.json").read_text())
    cells = [json.loads(p.read_text()) for p in sorted(out.glob("*/seed-*/cell.json"))]
    start = json.loads((out / "start.json").read_text()) if (out / "start.json").exists() else None
    result = analyse(cells, design)
    pilot_file = out / "pilot.json"
    references = out / "references.json"
    end_rate = (
        teacher_end_rate(json.loads(references.read_text()), design["max_tokens"]) if references.exists() else None
    )
    full = {
        "design": design,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "pilot": json.loads(pilot_file.read_text()) if pilot_file.exists() else None,
        "start": start,
        "held_out_teacher_end_rate": end_rate,
        **result,
        "cells": [{k: v for k, v in c.items() if k != "rounds"} | {"rounds": c["rounds"]} for c in cells],
    }
    write_no_follow(out / "results.json", json.dumps(full, indent=1))
    plot(cells, design.get("arms", ARMS), out / "distillation.png")
    print(markdown_table(result, start))
    if end_rate is not None:
        print(f"\nthe teacher's held-out samples ended within {design['max_tokens']} tokens at rate {end_rate:.3f}")
    return full


# ---------------------------------------------------------------------------------------------------- main

RESULT_FILES = ("design.json", "references.json", "start.json", "*/seed-*/cell.json")
"""What a run's results are, without its checkpoints: the files ``--archive`` keeps (a few MB for 32 cells)."""


def copy_missing(source: Path, target: Path) -> None:
    """Copy the result files of ``source`` that ``target`` lacks (a result, once written, never changes)."""
    for pattern in RESULT_FILES:
        for path in sorted(source.glob(pattern)):
            copy = target / path.relative_to(source)
            if not copy.exists():
                copy.parent.mkdir(parents=True, exist_ok=True)
                write_no_follow(copy, path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", choices=sorted(DESIGNS), default="second", help="which experiment (DESIGNS)")
    parser.add_argument("--output", default="bench-out/distill-2")
    parser.add_argument("--quick", action="store_true", help="the tiny random pair: a smoke run, not evidence")
    parser.add_argument("--pilot", action="store_true", help="run the design's pilot (pilot / pilot_second) and stop")
    parser.add_argument("--report", action="store_true", help="analyse the finished cells in --output, run nothing")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the design's)")
    parser.add_argument("--kl-budget", type=float, help="trust_region's starting ε (default: the design's)")
    parser.add_argument("--arms", help="a subset of the design's arms, for a partial run (default: all)")
    parser.add_argument(
        "--archive",
        type=Path,
        help="a folder kept in git that carries the run's results (RESULT_FILES) from machine to machine: copied into "
        "--output before the run and updated after each cell, so a run continues on a new checkout",
    )
    args = parser.parse_args()
    out = Path(args.output)
    if args.report:
        report(out)
        return
    changes: dict[str, Any] = {"quick": args.quick}
    if args.seeds:
        changes["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    if args.kl_budget is not None:
        changes["kl_budget"] = args.kl_budget
    if args.quick:
        changes.update(
            keep_layers=0, seeds=changes.get("seeds", (0, 1)), rounds=2, tokens_per_round=48, max_tokens=12,
            eval_prompts=4, loss_top_k=16, steps_per_round=2, learning_rate=1e-3,
            anneal_rounds=min(DESIGNS[args.design].anneal_rounds, 1),
        )  # fmt: skip
    design = dataclasses.replace(DESIGNS[args.design], **changes)
    arms = args.arms.split(",") if args.arms else list(design.arms)
    unknown = sorted(set(arms) - set(design.arms))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; this design's arms are {list(design.arms)}")
    out.mkdir(parents=True, exist_ok=True)
    if args.archive and not args.pilot:
        copy_missing(args.archive, out)
    saved = out / "design.json"
    mine = json.loads(json.dumps(dataclasses.asdict(design)))
    if saved.exists() and not args.pilot:
        before = json.loads(saved.read_text())
        first = json.loads(json.dumps(dataclasses.asdict(FIRST)))  # fields added since: the first run's values
        changed = sorted(k for k in mine if before.get(k, first[k]) != mine[k])
        if changed:
            raise SystemExit(f"{out} holds a run of another design (differs in {changed}); use another --output")
    if args.quick:
        teacher, theta = tiny_models.tiny_pair("same")
        prompts = out / "quick_prompts.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"question": f"Count from {i} to {i + 5}.", "answer": "1 2 3"}) + "\n" for i in range(60)
            )
        )
    else:
        teacher, theta = models.smollm2(), models.smollm2_pruned(design.keep_layers)
        prompts = DATA
    base = base_config(design, out, teacher, theta, prompts)
    rows = [json.loads(x) for x in prompts.read_text().splitlines() if x]
    import torch
    from transformers import AutoModelForCausalLM

    from dual_sampling import OptimalSamplingDual

    t0 = time.perf_counter()
    with OptimalSamplingDual(str(teacher), str(theta), **dataclasses.asdict(base.engine)) as dual:
        if args.pilot:
            run_pilot = pilot_second if design.rule == "helps" else pilot
            run_pilot(design, base, dual, rows[: -design.eval_prompts], out)
            return
        if not saved.exists():
            write_no_follow(saved, json.dumps(mine, indent=1))
        teacher_model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
        eos = sorted(dual.eos_token_ids)
        held = HeldOut(dual.tokenizer, eos, rows[-design.eval_prompts :], design, out, teacher_model)
        start = start_cell(base, held)
        if args.archive:
            copy_missing(out, args.archive)
        print(f"start: {PRIMARY} {start[PRIMARY]:.4f} at {time.perf_counter() - t0:.0f} s", flush=True)
        for seed in design.seeds:  # seed-major: a run cut short still has every arm of its first seeds
            for arm in arms:
                cell = run_cell(arm, seed, design, base, dual, held, seed == design.seeds[0])
                if args.archive:
                    copy_missing(out, args.archive)
                print(
                    f"{arm} seed {seed}: {PRIMARY} {cell[PRIMARY]:.4f}, tokens/round {cell['tokens_per_round']}, "
                    f"at {time.perf_counter() - t0:.0f} s",
                    flush=True,
                    file=sys.stderr,
                )
    report(out)


if __name__ == "__main__":
    main()
