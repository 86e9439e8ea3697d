"""Quickstart: sample from the geometric mixture of SmolLM2-135M-Instruct (teacher) and its
24-layer pruned copy (theta), and print the texts with α statistics.

    python examples/quickstart.py
"""

from __future__ import annotations

from transformers import AutoTokenizer

from dual_sampling import OptimalSamplingDual, models

QUESTIONS = [
    "What is 12 times 7?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
]


def main() -> None:
    teacher, theta = models.smollm2(), models.smollm2_pruned(24)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    with OptimalSamplingDual(teacher, theta, alpha_method="kl_symmetry", max_num_seqs=4, max_model_len=512) as sampler:
        out = sampler.generate(prompts, max_tokens=64, temperature=0.8, seed=0)
        for question, request in zip(QUESTIONS, out.requests):
            sample = request.samples[0]
            mean_alpha = sum(sample.alpha) / max(len(sample.alpha), 1)
            print(
                f"\nQ: {question}\nA: {sample.text.strip()}\n   ({len(sample.token_ids)} tokens, "
                f"mean α {mean_alpha:.3f}, log w_theta {sample.log_w_theta:.2f}, finish {sample.finish_reason})"
            )
        stats = out.alpha_stats
        print(
            f"\nα (teacher weight) over {stats['count']} tokens: mean {stats['mean']:.3f}, std {stats['std']:.3f}, "
            f"min {stats['min']:.3f}, max {stats['max']:.3f}"
        )
        sync = sampler.get_sync_statistics()
        print(
            f"sync: {sync['teacher_rows']} rows, teacher waited {sync['teacher_wait_s']:.2f} s, theta waited "
            f"{sync['theta_wait_s']:.2f} s, mixing {sync['mix_s']:.2f} s, "
            f"timeouts {sync['teacher_timeouts'] + sync['theta_timeouts']}"
        )


if __name__ == "__main__":
    main()
