"""A pair end to end on a GPU: the dual engine's records re-scored with transformers, and its speed against the teacher.

    python examples/gpu_smoke.py --teacher Qwen/Qwen2.5-7B-Instruct --theta Qwen/Qwen2.5-1.5B-Instruct

(local folders; nothing is downloaded here). It needs vLLM with a GPU (the ``gpu`` extra) and prints:

- the row transport the engines chose (``row_transport``: device on one GPU) and the dual engine's throughput;
- the teacher alone generating the same tokens for the same prompts (its own vLLM engine), and the ratio;
- every record of the first samples against transformers re-scoring on the GPU: log π_t and log π_θ at each token,
  and log q at the recorded α, with the largest differences (float32 models: about 1e-3 is expected on a GPU).

``--cpu`` runs the same script on the CPU with the tiny test models, to check the script itself.
Exit status 1 if a record is off by more than ``--atol``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about a lighthouse.",
    "What is 17 times 23? Show the steps.",
    "Give three uses of a paper clip.",
]


def teacher_alone(teacher: str, prompts: list[list[int]], tokens: int, max_len: int, dtype: str) -> float:
    """Seconds for the teacher's own vLLM engine to generate exactly ``tokens`` per prompt."""
    from vllm import LLM, SamplingParams

    from dual_sampling.options import default_kv_cache_bytes

    # The dual engine's own sizing: room for every sequence, no preemption (and no 90 % of the device's memory).
    kv_bytes = default_kv_cache_bytes(teacher, len(prompts), max_len, dtype)
    llm = LLM(
        model=teacher,
        dtype=dtype,
        max_model_len=max_len,
        max_num_seqs=len(prompts),
        kv_cache_memory_bytes=kv_bytes,
        enforce_eager=True,
        seed=0,
    )
    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    del llm
    return seconds


@torch.no_grad()
def rescore(model, prompt: list[int], tokens: list[int], vocab: int, device: str) -> torch.Tensor:
    """Teacher-forced log-softmax ``[T, vocab]`` (float64) of ``model`` predicting each of ``tokens``."""
    ids = torch.tensor([prompt + tokens], device=device)
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens), :vocab]
    return torch.log_softmax(logits.double(), -1).cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher")
    parser.add_argument("--theta")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sample (every sample runs to it)")
    parser.add_argument("--samples", type=int, default=2, help="samples per prompt")
    parser.add_argument("--atol", type=float, default=5e-3, help="largest record difference allowed, in nats")
    parser.add_argument("--cpu", action="store_true", help="the tiny test pair on the CPU (checks the script)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from dual_sampling import OptimalSamplingDual

    if args.cpu:
        from dual_sampling.testing import tiny_models

        args.teacher, args.theta = (str(p) for p in tiny_models.tiny_pair("same"))
        device, dtype = "cpu", "float32"
    elif not torch.cuda.is_available():
        print("no CUDA device (use --cpu to check the script on the CPU)")
        return 2
    elif not (args.teacher and args.theta):
        parser.error("--teacher and --theta are local model folders")
    else:
        device, dtype = "cuda", "float32"
    max_len = 512
    with OptimalSamplingDual(args.teacher, args.theta, max_model_len=max_len, dtype=dtype, use_tqdm=False) as dual:
        tok = dual.tokenizer
        chats = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in PROMPTS
        ]
        dual.generate(chats[:1], max_tokens=4)  # warm-up
        start = time.perf_counter()
        out = dual.generate(chats, n=args.samples, max_tokens=args.tokens, min_tokens=args.tokens, seed=1)
        dual_s = time.perf_counter() - start
        stats = dual.get_sync_statistics()
        vocab, stop_ids = dual.vocab, list(dual.eos_token_ids)
    tokens = sum(out.num_tokens)
    prompts = [r.teacher_prompt_token_ids for r in out.requests for _ in r.samples]
    alone_s = teacher_alone(args.teacher, prompts, args.tokens, max_len, dtype)
    print(f"row_transport: {stats['row_transport']}")
    print(f"dual engine: {tokens} tokens in {dual_s:.2f} s ({tokens / dual_s:.1f} tok/s)")
    print(f"teacher alone: {tokens} tokens in {alone_s:.2f} s ({tokens / alone_s:.1f} tok/s)")
    print(f"dual / teacher alone, throughput: {alone_s / dual_s:.3f}")

    paths = {"teacher": args.teacher, "theta": args.theta}
    models = {role: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for role, path in paths.items()}
    models = {role: model.eval().to(device) for role, model in models.items()}
    worst = {"logp_teacher": 0.0, "logp_theta": 0.0, "logq": 0.0}
    for request in out.requests[:2]:
        for sample in request.samples:
            lt = rescore(models["teacher"], request.teacher_prompt_token_ids, sample.token_ids, vocab, device)
            lth = rescore(models["theta"], request.theta_prompt_token_ids, sample.token_ids, vocab, device)
            ids = torch.tensor(sample.token_ids).unsqueeze(-1)
            alpha = torch.tensor(sample.alpha, dtype=torch.float64).unsqueeze(-1)
            mixed = (1 - alpha) * lth + alpha * lt
            mixed[:, stop_ids] = float("-inf")  # every token is before min_tokens: the EOS ids are masked from q
            logq = torch.log_softmax(mixed, -1)
            expected = {"logp_teacher": lt, "logp_theta": lth, "logq": logq}
            for name, rows in expected.items():
                got = torch.tensor(getattr(sample, name), dtype=torch.float64)
                worst[name] = max(worst[name], float((got - rows.gather(-1, ids).squeeze(-1)).abs().max()))
    print("largest record differences against transformers (nats):", worst)
    if max(worst.values()) > args.atol:
        print(f"FAILED: a record is off by more than {args.atol}")
        return 1
    print("records agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
