"""Quickstart: what the mixture is for, on SmolLM2-135M-Instruct (the teacher) and its 24-layer pruned copy (theta).

For the same prompts and seeds it draws three times from one engine pair and prints them side by side:

- **theta alone** (α = 0: q = π_θ, so log w = log π_θ − log q is 0);
- **the teacher alone** (α = 1: q = π_t; the student's own weights would price these tokens at log w);
- **the mixture** q ∝ π_θ^(1−α)·π_t^α with α chosen per token (kl_symmetry).

The last question's teacher sees a hint the student does not (a privileged field, as self-distillation rows carry).
α is the teacher weight; log w sums log π_θ − log q over a sample's tokens (the trainer's importance weight). The
draws are at temperature 1, so that log w prices q against π_θ itself (at another temperature q is the tempered law
and θ alone has log w ≠ 0).

    python examples/quickstart.py
"""

from __future__ import annotations

from transformers import AutoTokenizer

from dual_sampling import OptimalSamplingDual, models

QUESTIONS = [
    "What is 12 times 7?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 15 plus 27?",
]
HINT = "Hint: 15 plus 27 is 42; say so in one sentence. "
"""Seen by the teacher only, before the last question."""

LAWS = [
    ("theta alone", "fixed", {"alpha": 0.0}),
    ("teacher alone", "fixed", {"alpha": 1.0}),
    ("mixture q", "kl_symmetry", {}),
]
"""(label, alpha method, its settings): the three laws drawn from, with the same seeds."""


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def main() -> None:
    teacher, theta = models.smollm2(), models.smollm2_pruned(24)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    teacher_prompts = [*prompts[:-1], chat(tokenizer, HINT + QUESTIONS[-1])]
    answers = {}
    with OptimalSamplingDual(teacher, theta, max_num_seqs=4, max_model_len=512) as sampler:
        for label, method, settings in LAWS:
            sampler.update_alpha(method, **settings)
            out = sampler.generate(prompts, teacher_prompts, max_tokens=48, seed=0)
            answers[label] = [request.samples[0] for request in out.requests]
        sync = sampler.get_sync_statistics()
    for i, question in enumerate(QUESTIONS):
        print(
            f"\nQ: {question}" + ("   (the teacher was told: " + HINT.strip() + ")" if i == len(QUESTIONS) - 1 else "")
        )
        for label, _, _ in LAWS:
            sample = answers[label][i]
            mean_alpha = sum(sample.alpha) / max(len(sample.alpha), 1)
            text = " ".join(sample.text.split())
            print(f"  {label:<13} mean α {mean_alpha:.2f}  log w {sample.log_w_theta:7.2f}  | {text[:90]}")
    print(
        f"\nlockstep: {sync['teacher_rows']} rows mixed; the engines waited {sync['teacher_wait_s']:.1f} s (teacher) "
        f"and {sync['theta_wait_s']:.1f} s (theta) for each other; "
        f"timeouts {sync['teacher_timeouts'] + sync['theta_timeouts']}"
    )


if __name__ == "__main__":
    main()
