"""TRL's GRPO with mixture rollouts: trust-region blending on GSM8K problems, annealed through the trainer's steps.

The TRL quick-start's GRPOTrainer, with three changes: the trainer is built by ``MixtureRollouts.trainer`` (its
rollouts come from q ∝ π_θ^(1−α)·π_t^α with SmolLM2-135M-Instruct as the teacher), ``use_vllm=True`` (the path whose
generation mixture rollouts replace), and a callback that anneals the trust-region budget ε linearly to 0 over the
first half of the steps (trust-region behaviour blending; the second half samples from the student alone). The
student is SmolLM2's 24-layer pruned copy; the problems ship in examples/data/gsm8k.

    python examples/trl_grpo_mixture.py --steps 8

Writes bench-out/trl_grpo/metrics.json and trl_grpo.png: per step, the reward, mean α, ε and the sampler–trainer
mismatch (nats) of the batch drawn after that step's weight sync.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
PROBLEMS = EXAMPLES / "data" / "gsm8k" / "subset.jsonl"


def problems(count: int):
    """GSM8K problems as TRL's conversational prompts, with the final answer beside each."""
    from datasets import Dataset

    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines()[:count]]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["question"] + " Give the final number after ####."}],
                "answer": r["answer"].split("####")[-1].strip().replace(",", ""),
            }
            for r in rows
        ]
    )


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(completions, answer, **_) -> list[float]:
    """1 where the completion's last number is the answer."""
    out = []
    for completion, truth in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", _text(completion).replace(",", ""))
        out.append(float(bool(numbers) and float(numbers[-1]) == float(truth)))
    return out


def shows_working(completions, **_) -> list[float]:
    """0.2 for a completion that writes a number at all (a small shaping reward: the tiny student rarely scores)."""
    return [0.2 * bool(re.search(r"\d", _text(c))) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kl-budget", type=float, default=0.8, help="ε₀, nats per token (the pilot's value)")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4, help="rollouts per prompt (GRPO's group)")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--output", default="bench-out/trl_grpo")
    cli = parser.parse_args()

    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dual_sampling import EngineOptions, models
    from dual_sampling.integrations.trl import MixtureRollouts

    teacher, student = models.smollm2(), models.smollm2_pruned(24)
    out_dir = Path(cli.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    half = max(1, cli.steps // 2)

    class AnnealTrustRegion(TrainerCallback):
        """ε·max(0, 1 − step/half) before each step's rollouts: ε₀ at step 0, 0 from the middle of the run on."""

        def __init__(self, rollouts: MixtureRollouts) -> None:
            self.rollouts, self.budgets = rollouts, []

        def on_step_begin(self, args, state, control, **kwargs):
            budget = cli.kl_budget * max(0.0, 1.0 - state.global_step / half)
            self.rollouts.update_alpha("trust_region", kl_budget=budget)
            self.budgets.append(budget)

    engine = EngineOptions(
        alpha_method="trust_region", alpha_config={"kl_budget": cli.kl_budget}, max_num_seqs=8, max_model_len=512
    )
    with MixtureRollouts(teacher=str(teacher), engine=engine) as rollouts:
        args = GRPOConfig(
            output_dir=str(out_dir / "trainer"),
            use_vllm=True,  # TRL's vLLM path: the one whose generation mixture rollouts replace
            per_device_train_batch_size=cli.prompts_per_step * cli.generations,
            num_generations=cli.generations,
            max_completion_length=cli.max_completion_length,
            max_steps=cli.steps,
            learning_rate=1e-5,
            vllm_importance_sampling_correction=True,  # exact for the mixture: TRL receives log q
            # Per-token weights π_θ/q, capped at 3. GRPO's default, a sequence's product of them, is exact as well,
            # but shrinks toward 0 over a long completion wherever the teacher pulled q away from π_θ.
            vllm_importance_sampling_mode="token_truncate",
            bf16=False,  # float32 on CPU; the engines run float32 too
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
        )
        trainer = rollouts.trainer(
            GRPOTrainer,
            model=str(student),
            reward_funcs=[correct, shows_working],
            args=args,
            train_dataset=problems(cli.steps * cli.prompts_per_step),
        )
        anneal = AnnealTrustRegion(rollouts)
        trainer.add_callback(anneal)
        trainer.train()

    rows = [row for row in trainer.state.log_history if "mixture/alpha_mean" in row]
    per_step = [
        {
            "step": row["step"],
            "kl_budget": budget,
            "reward": row["reward"],
            "alpha_mean": row["mixture/alpha_mean"],
            "sampler_mismatch_max": row.get("mixture/sampler_mismatch_max"),
            "loss": row["loss"],
        }
        for row, budget in zip(rows, anneal.budgets)
    ]
    (out_dir / "metrics.json").write_text(json.dumps(per_step, indent=1))
    for row in per_step:
        print(
            f"step {row['step']:2d}  ε {row['kl_budget']:.2f}  mean α {row['alpha_mean']:.3f}  reward "
            f"{row['reward']:.2f}  |Δlog π_θ| max {row['sampler_mismatch_max']:.1e}  loss {row['loss']:.3g}"
        )
    plot(per_step, out_dir / "trl_grpo.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    axes[0].plot(steps, [r["reward"] for r in rows], marker="o")
    axes[0].set_title("reward (mean over rollouts)")
    axes[1].plot(steps, [r["alpha_mean"] for r in rows], marker="o", label="mean α")
    axes[1].plot(steps, [r["kl_budget"] for r in rows], marker="s", label="ε (nats/token)")
    axes[1].set_title("teacher weight α and the budget ε")
    axes[1].legend()
    axes[2].semilogy(steps, [max(r["sampler_mismatch_max"] or 0.0, 1e-9) for r in rows], marker="o")
    axes[2].set_title("sampler–trainer mismatch (max, nats)")
    for ax in axes:
        ax.set_xlabel("trainer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
