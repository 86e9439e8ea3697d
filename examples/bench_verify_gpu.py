"""What a teacher forward that verifies γ drafted tokens costs against one decode step, on a GPU (vLLM not needed).

    PYTHONPATH=. python3 examples/bench_verify_gpu.py --output bench-out/verify-gpu.json

The speculative mode (docs/theory.md, "Speculative mixture sampling") trades γ of theta's decode steps and one
teacher forward over γ + 1 positions for the (1 − a^γ)/(1 − a) tokens that round emits on average, where a is the
mean acceptance Σ_y min(π_θ(y), q(y)). Whether that beats lockstep turns on three costs this script measures:

- the teacher's decode step (one new position per sequence) and its verification forward (γ + 1 positions);
- theta's decode step;
- the teacher's prefill per token (what a peer pipeline pays to score a finished completion).

The models are decoders with Qwen2.5-7B's and Qwen2.5-1.5B's shapes, built from plain matrix products: per layer
the fused qkv projection, attention over ``--context`` cached positions (``scaled_dot_product_attention`` with
grouped heads), the output projection, the fused gate/up projection, SiLU·mul and the down projection, then the
vocabulary projection at every new position (verification needs all γ + 1 rows). Random bf16 weights; norms and
rotary embeddings are left out (elementwise work, under 2 % of the bytes). Each forward is captured in a CUDA
graph, as vLLM's decode steps are, so the times are the kernels', not Python's.

The decisions are timed too, each as its mode runs it: ``decide()`` (the fused kernel, kl_symmetry) on b rows for
lockstep, and ``verify_drafts()`` (the speculative step's torch code: α, q and the acceptances for every row, one draw
per span) on b spans of γ drafts and a bonus row.

``--cpu`` runs the same on this machine's CPU with the default pair's shapes (float32, no graphs), the figures the
speculative mode's CPU benchmark (examples/bench_speculative.py) can be checked against.

Then, for each acceptance given, the tokens per second of four layouts per sequence batch, side by side:
lockstep on one GPU (teacher + theta + decision per token), lockstep on two (max of the two + decision), the
speculative round on one GPU, and the peers' student-then-teacher-prefill pipeline on one GPU; and
``dual_vs_student_plus_teacher_prefill`` for lockstep and for speculative at the best γ. It writes one JSON file and
a Markdown table beside it. ``--smoke`` runs tiny shapes on the CPU to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes (Qwen2.5's names)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate
        return dtype_bytes * (self.layers * per_layer + self.hidden * self.vocab)


TEACHER_7B = Shape(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064)
THETA_1_5B = Shape(hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=152064)
SMOLLM2 = Shape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
SMOLLM2_24 = dataclasses.replace(SMOLLM2, layers=24)
"""The default pair of this project (SmolLM2-135M and its 24-layer prune), for ``--cpu``."""
SMOKE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=600)


class Decoder:
    """A forward over ``new`` positions per sequence for ``batch`` sequences with ``context`` cached positions."""

    def __init__(
        self, shape: Shape, batch: int, context: int, new: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.shape, self.batch, self.context = shape, batch, context
        s = shape

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dtype) * cols**-0.5

        self.layers = [
            {
                "qkv": weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
                "o": weight(s.hidden, s.heads * s.head_dim),
                "gate_up": weight(2 * s.intermediate, s.hidden),
                "down": weight(s.hidden, s.intermediate),
                # The cache has room for the new positions, written in place as a paged cache's are.
                "k": torch.randn(batch, s.kv_heads, context + new, s.head_dim, device=device, dtype=dtype),
                "v": torch.randn(batch, s.kv_heads, context + new, s.head_dim, device=device, dtype=dtype),
            }
            for _ in range(s.layers)
        ]
        self.lm_head = weight(s.vocab, s.hidden)
        self.device, self.dtype = device, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, new, hidden]`` → logits ``[batch, new, vocab]``."""
        s, b, n = self.shape, x.shape[0], x.shape[1]
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for layer in self.layers:
            q, k, v = (x @ layer["qkv"].T).split([q_size, kv_size, kv_size], -1)
            q = q.view(b, n, s.heads, s.head_dim).transpose(1, 2)
            end = self.context + n
            layer["k"][:, :, self.context : end] = k.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            layer["v"][:, :, self.context : end] = v.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, layer["k"][:, :, :end], layer["v"][:, :, :end], enable_gqa=True)
            x = x + attn.transpose(1, 2).reshape(b, n, q_size) @ layer["o"].T
            gate, up = (x @ layer["gate_up"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        return x @ self.lm_head.T

    def time_ms(self, new: int, repeats: int) -> float:
        """Median time of one forward over ``new`` positions per sequence (a CUDA graph's replay on a GPU)."""
        x = torch.randn(self.batch, new, self.shape.hidden, device=self.device, dtype=self.dtype)
        if self.device.type != "cuda":
            return _median_ms(lambda: self.forward(x), self.device, repeats)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.forward(x)
        result = _median_ms(graph.replay, self.device, repeats)
        del graph
        return result


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decision_ms(rows: int, vocab: int, device: torch.device, repeats: int) -> float:
    """``decide()`` (fused, kl_symmetry) on ``rows`` rows of ``vocab``: lockstep's per-step decision."""
    from alpha import get_alpha_computer
    from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide

    teacher, theta = _rows(rows, vocab, device)
    sampling = [RowSampling(seed=i) for i in range(rows)]
    computer = get_alpha_computer("kl_symmetry")
    warm = torch.full((rows,), 0.45, device=device)
    return _median_ms(
        lambda: decide(ModelRows.pair(teacher, theta, theta_normalized=True), [1] * rows, sampling, computer, warm),
        device,
        repeats,
    )


def verification_ms(batch: int, gamma: int, vocab: int, device: torch.device, repeats: int) -> float:
    """``verify_drafts()`` (kl_symmetry), what the speculative mode's step runs: ``batch`` spans of γ drafts, each
    with its bonus row (γ + 1 rows a span, the most a step can check)."""
    from alpha import get_alpha_computer
    from dual_sampling.decision.rows import ModelRows
    from dual_sampling.decision.speculative import Span, verify_drafts

    rows = batch * (gamma + 1)
    teacher, theta = _rows(rows, vocab, device)
    spans = [Span(k * (gamma + 1), tuple(range(1, gamma + 1)), seed=k, step=0, bonus_row=True) for k in range(batch)]
    computer = get_alpha_computer("kl_symmetry")
    return _median_ms(
        lambda: verify_drafts(ModelRows.pair(teacher, theta, theta_normalized=True), spans, computer), device, repeats
    )


def _rows(rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher logits and theta log-probabilities ``[rows, vocab]`` as the decisions receive them."""
    g = torch.Generator().manual_seed(0)
    teacher = (3.0 * torch.randn(rows, vocab, generator=g)).to(device)
    theta = torch.log_softmax(1.5 * torch.randn(rows, vocab, generator=g), -1).to(device)
    return teacher, theta


def tokens_per_round(acceptance: float, gamma: int) -> float:
    """Mean tokens a round emits: accepted drafts, plus the residual draw at the first rejection (no bonus token
    after γ accepted drafts, which has no θ row): Σ_{j<γ} a^j."""
    return sum(acceptance**j for j in range(gamma))


def model(figures: dict, acceptances: list[float], gammas: list[int]) -> list[dict]:
    """Milliseconds per emitted token for each layout, from the measured costs."""
    out = []
    for b, f in figures.items():
        t_dec, s_dec, decision = f["teacher_decode_ms"], f["theta_decode_ms"], f["decision_ms"]
        peers = (s_dec + b * f["teacher_prefill_ms_per_token"]) / b
        lockstep_one = (t_dec + s_dec + decision) / b
        lockstep_two = (max(t_dec, s_dec) + decision) / b
        for a in acceptances:
            spec = {}
            for g in gammas:
                round_ms = g * s_dec + f[f"teacher_verify_{g}_ms"] + f[f"decision_{g}_ms"]
                spec[g] = round_ms / (b * tokens_per_round(a, g))
            best = min(spec, key=spec.get)
            out.append(
                {
                    "batch": b,
                    "acceptance": a,
                    "ms_per_token": {
                        "peers": peers,
                        "lockstep_one_gpu": lockstep_one,
                        "lockstep_two_gpus": lockstep_two,
                        **{f"speculative_{g}": v for g, v in spec.items()},
                    },
                    "best_gamma": best,
                    # Any exact sampler of q needs a θ row and a teacher position per emitted token; a round checks γ
                    # drafts for Σ_{j<γ} a^j tokens, so this share of its θ rows and teacher positions is used.
                    "speculative_work_used": tokens_per_round(a, best) / best,
                    "lockstep_vs_peers": peers / lockstep_one,
                    "speculative_vs_peers": peers / spec[best],
                    "speculative_vs_lockstep_one_gpu": lockstep_one / spec[best],
                }
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="bench-out/verify-gpu.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--context", type=int, default=1024, help="cached positions per sequence")
    parser.add_argument("--prefill", type=int, default=512, help="positions per sequence of the peers' scoring pass")
    parser.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        default=[0.61, 0.78],
        help="mean acceptances to model (the default pair's, measured on the CPU: kl_symmetry and α = 0.25)",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--cpu", action="store_true", help="the default pair's shapes (SmolLM2-135M, 24-layer theta), float32, CPU"
    )
    args = parser.parse_args()
    if args.smoke:
        device, dtype, teacher_shape, theta_shape = torch.device("cpu"), torch.float32, SMOKE, SMOKE
        args.batches, args.context, args.prefill, args.repeats = [2], 16, 8, 2
    elif args.cpu:
        device, dtype, teacher_shape, theta_shape = torch.device("cpu"), torch.float32, SMOLLM2, SMOLLM2_24
        args.context, args.prefill, args.repeats = 256, 128, 5
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU")
        return 2
    else:
        device, dtype, teacher_shape, theta_shape = torch.device("cuda"), torch.bfloat16, TEACHER_7B, THETA_1_5B
    figures = {}
    for b in args.batches:
        teacher = Decoder(teacher_shape, b, args.context, max(args.gammas) + 1, device, dtype)
        f = {
            "teacher_decode_ms": teacher.time_ms(1, args.repeats),
            **{f"teacher_verify_{g}_ms": teacher.time_ms(g + 1, args.repeats) for g in args.gammas},
        }
        del teacher
        prefill_batch = min(b, 8)
        scorer = Decoder(teacher_shape, prefill_batch, args.context - args.prefill, args.prefill, device, dtype)
        f["teacher_prefill_ms_per_token"] = scorer.time_ms(args.prefill, max(3, args.repeats // 4)) / (
            prefill_batch * args.prefill
        )
        del scorer
        theta = Decoder(theta_shape, b, args.context, 1, device, dtype)
        f["theta_decode_ms"] = theta.time_ms(1, args.repeats)
        del theta
        f["decision_ms"] = decision_ms(b, teacher_shape.vocab, device, args.repeats)
        for g in args.gammas:
            f[f"decision_{g}_ms"] = verification_ms(b, g, teacher_shape.vocab, device, args.repeats)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        figures[b] = f
        print(json.dumps({"batch": b, **f}), flush=True)
    layouts = model(figures, args.acceptance, args.gammas)
    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else ("cpu (smoke)" if args.smoke else "cpu"),
        "torch": torch.__version__,
        "teacher": {**asdict(teacher_shape), "weight_gb": teacher_shape.weight_bytes() / 1e9},
        "theta": {**asdict(theta_shape), "weight_gb": theta_shape.weight_bytes() / 1e9},
        "context": args.context,
        "repeats": args.repeats,
        "figures": {str(b): f for b, f in figures.items()},
        "layouts": layouts,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"Device: {report['device']} (torch {report['torch']}); medians of {args.repeats} "
        f"{'CUDA-graph replays' if device.type == 'cuda' else 'forwards'}; context {args.context}.",
        "",
        "| b | teacher decode ms | verify γ=" + " / ".join(map(str, args.gammas)) + " ms | theta decode ms "
        "| prefill µs/token | decision ms |",
        "|---|---|---|---|---|---|",
    ]
    for b, f in figures.items():
        verify = " / ".join(f"{f[f'teacher_verify_{g}_ms']:.2f}" for g in args.gammas)
        lines.append(
            f"| {b} | {f['teacher_decode_ms']:.2f} | {verify} | {f['theta_decode_ms']:.2f} | "
            f"{1e3 * f['teacher_prefill_ms_per_token']:.1f} | {f['decision_ms']:.3f} |"
        )
    lines += [
        "",
        "| b | acceptance | best γ | lockstep vs peers | speculative vs peers | speculative vs lockstep (one device) "
        "| work used |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in layouts:
        lines.append(
            f"| {r['batch']} | {r['acceptance']:.2f} | {r['best_gamma']} | {r['lockstep_vs_peers']:.2f} | "
            f"{r['speculative_vs_peers']:.2f} | {r['speculative_vs_lockstep_one_gpu']:.2f} | "
            f"{r['speculative_work_used']:.2f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
