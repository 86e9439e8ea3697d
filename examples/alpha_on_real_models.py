"""α along a real answer: teacher-force SmolLM2 and its pruned copy over the teacher's own reply
and print, per method, the mean and spread of the teacher weight α the alpha computers pick.

    python examples/alpha_on_real_models.py
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alpha import available_alpha_methods, get_alpha_computer
from dual_sampling import models

PROMPTS = ["What is 12 times 7?", "Name three primary colours.", "Write one sentence about the sea."]


def main() -> None:
    teacher_dir, theta_dir = models.smollm2(), models.smollm2_pruned()
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    theta = AutoModelForCausalLM.from_pretrained(theta_dir, dtype=torch.float32).eval()
    computers = {m: get_alpha_computer(m) for m in available_alpha_methods()}
    alphas: dict[str, list[torch.Tensor]] = {m: [] for m in computers}
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            full = teacher.generate(ids, max_new_tokens=40, do_sample=False)
            n = full.shape[1] - ids.shape[1]
            logp_t = torch.log_softmax(teacher(full).logits[0, -n - 1 : -1], -1)
            logp_th = torch.log_softmax(theta(full).logits[0, -n - 1 : -1], -1)
        print(f"\n{prompt!r} -> {tokenizer.decode(full[0, ids.shape[1] :], skip_special_tokens=True)!r}")
        for m, ac in computers.items():
            alphas[m].append(ac(logp_th, logp_t))
    print("\nteacher weight α per token over all replies")
    for m, values in alphas.items():
        a = torch.cat(values)
        print(f"  {m:12s} mean {a.mean():.3f}  std {a.std():.3f}  min {a.min():.3f}  max {a.max():.3f}")


if __name__ == "__main__":
    main()
