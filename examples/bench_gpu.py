"""GPU check and benchmark of the decision and of the row transports, on any CUDA machine (vLLM not needed).

    make gpu-check      # PYTHONPATH=. python3 examples/bench_gpu.py --output bench-out/gpu-check.json

Checks first; the script exits with status 1 if one fails:

- the Triton kernel (``dual_sampling.decision.gpu_kernel``) against the CPU kernel on the same rows and uniforms,
  every other row with its teacher's three most likely tokens masked (as the stop tokens before min_tokens), every
  fourth penalised and diverse (frequency and presence penalties, a group's earlier member), and every fourth forced
  to α = 1 (the first token): the same tokens (a draw at a CDF boundary may round either way: at most
  one row in 64 differs), α and records within 1e-4;
- the pinned and the device row transports read back what was written, the device one from a second process
  (CUDA IPC), as the engines use it.

Then medians of ``--repeats`` runs, float32 rows, at b ∈ {8, 64, 256} and V ∈ {151,936, 262,144}:

- ``decide()`` with the fused kernel (kl_symmetry and fixed), and with the torch reference (``fused=False``);
- a plain sampler on the same rows (softmax and an exponential race): what any sampler pays;
- host synchronisations in one ``decide()`` call, counted by torch's sync debug mode;
- each transport's publish and read of b rows: host (log-softmax, to the CPU, into shared memory; back to the GPU),
  pinned, device.

It writes one JSON file (the device's name, the versions, every figure) and a Markdown table beside it.
``--smoke`` runs the same code on the CPU, with Triton's interpreter and tiny sizes, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DECODE_FLOOR_MS = 5.6
"""A 7B teacher's decode step reads its 15 GB of weights: about 5.6 ms at an H100's 2.7 TB/s."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (compilation, allocations)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rows(b: int, vocab: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher logits, theta log-probabilities) ``[b, V]`` float32 that disagree, as the engines hand them over."""
    g = torch.Generator().manual_seed(seed)
    teacher = 3.0 * torch.randn(b, vocab, generator=g)
    theta = torch.log_softmax(1.5 * torch.randn(b, vocab, generator=g), -1)
    return teacher.to(device), theta.to(device)


def host_syncs(fn, device: torch.device) -> int:
    """Host synchronisations ``fn`` makes (torch's sync debug mode warns at each); -1 off CUDA."""
    if device.type != "cuda":
        return -1
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_kernel(device: torch.device, vocab: int) -> dict:
    """The Triton kernel against the CPU kernel: tokens, α and records, on plain, masked, penalised and forced rows.

    A masked row's draw reads block sums its masked tokens were taken out of: a sum read before that store (a missing
    barrier) draws another token than the CPU kernel does."""
    from alpha import get_alpha_computer
    from dual_sampling.decision.edits import row_edits
    from dual_sampling.decision.gpu_kernel import decide_gpu
    from dual_sampling.decision.kernel import decide_fused
    from dual_sampling.decision.pipeline import ModelRows, RowSampling, counter_uniform

    b = 64 if device.type == "cuda" else 4
    teacher, theta = rows(b, vocab, device, seed=1)
    uniforms = [counter_uniform(11, s) for s in range(b)]
    top = teacher.topk(3, dim=-1).indices.tolist()
    masked = [top[r] if r % 2 else [] for r in range(b)]
    forced = [r % 4 == 3 for r in range(b)]
    # Every fourth row penalised (frequency and presence, on its teacher's top tokens as its output so far) and in a
    # diverse group whose earlier member took its top token: the edits both kernels apply after α.
    penalised = [r % 4 == 2 for r in range(b)]
    edited = dict(frequency_penalty=1.2, presence_penalty=0.5, diversity_penalty=2.0, group=1)
    rows_settings = [
        RowSampling(min_tokens=1, stop_token_ids=tuple(masked[r]), **(edited if penalised[r] else {})) for r in range(b)
    ]
    outputs = [top[r] + top[r][:1] if penalised[r] else [] for r in range(b)]
    taken = [{top[r][0]: 1} if penalised[r] else {} for r in range(b)]
    edits = row_edits(rows_settings, [0] * b, outputs, vocab, [0.0] * b, taken)
    report = {}
    for name, computer in (("kl_symmetry", get_alpha_computer("kl_symmetry")), ("fixed", get_alpha_computer("fixed"))):
        out = decide_gpu(
            ModelRows.pair(teacher, theta, theta_normalized=True), uniforms, forced, computer, None, edits=edits
        ).cpu()
        cpu, _ = decide_fused(
            ModelRows.pair(teacher.cpu(), theta.cpu(), theta_normalized=True), uniforms, forced, computer, None, edits
        )
        cpu = torch.from_numpy(cpu)
        same = float((out[:, 0] == cpu[:, 0]).double().mean())
        worst = float((out[:, 1:5] - cpu[:, 1:5]).abs().max())
        report[name] = {
            "rows": b,
            "masked_rows": sum(map(bool, masked)),
            "penalised_diverse_rows": sum(penalised),
            "forced_rows": sum(forced),
            "same_tokens": same,
            "max_record_diff": worst,
            "handed_back": int((out[:, 5] != 0).sum()),
            "ok": same >= 63 / 64 and worst <= 1e-4 and not (out[:, 5] != 0).any(),
        }
    return report


def _theta_side(handle_path: str, done) -> None:
    from dual_sampling.lockstep.row_channel import DeviceRows

    channel = DeviceRows.attach(Path(handle_path), timeout=60)
    channel.publish([3, 0], torch.arange(16, dtype=torch.float32, device="cuda").reshape(2, 8))
    done.set()


def check_transports(device: torch.device) -> dict:
    """The pinned and device transports read back what was written (device: written from a second process)."""
    from dual_sampling.lockstep.row_channel import DeviceRows, PinnedRows

    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    shared = np.full((4, 1000), np.nan, dtype=np.float32)
    pinned = PinnedRows(shared, device)
    try:
        written = torch.randn(2, 1000, device=device)
        pinned.publish([2, 0], written)
        pinned_ok = bool(np.array_equal(shared[[2, 0]], written.cpu().numpy()))
        pinned_ok &= bool(torch.equal(pinned.read([0, 2], device), written[[1, 0]]))
    finally:
        pinned.close()
    with tempfile.TemporaryDirectory() as folder:
        handle = Path(folder) / "session.rows"
        teacher = DeviceRows.create(handle, 4, 8, device)
        context = multiprocessing.get_context("spawn")
        done = context.Event()
        theta = context.Process(target=_theta_side, args=(str(handle), done))
        theta.start()
        published = done.wait(120)
        theta.join(60)
        got = teacher.read([3, 0], device).cpu()
        device_ok = published and bool(torch.equal(got, torch.arange(16, dtype=torch.float32).reshape(2, 8)))
    return {"pinned": {"ok": pinned_ok}, "device": {"ok": device_ok}}


def bench_decision(device: torch.device, b: int, vocab: int, repeats: int) -> dict:
    from alpha import get_alpha_computer
    from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide

    teacher, theta = rows(b, vocab, device)
    sampling = [RowSampling(seed=i) for i in range(b)]
    steps = [1] * b
    warm = torch.full((b,), 0.45, device=device)
    out: dict = {}
    for name in ("kl_symmetry", "fixed"):
        computer = get_alpha_computer(name)

        def fused(computer=computer):
            decide(ModelRows.pair(teacher, theta, theta_normalized=True), steps, sampling, computer, warm)

        def reference(computer=computer):
            decide(ModelRows.pair(teacher, theta, theta_normalized=True), steps, sampling, computer, warm, fused=False)

        out[f"decide_{name}_ms"] = median_ms(fused, device, repeats)
        out[f"reference_{name}_ms"] = median_ms(reference, device, max(1, repeats // 4))
        out[f"host_syncs_{name}"] = host_syncs(fused, device)

    def plain_sampler():
        probs = torch.softmax(teacher, -1)
        (probs / torch.empty_like(probs).exponential_()).argmax(-1).cpu()

    out["plain_sampler_ms"] = median_ms(plain_sampler, device, repeats)
    return out


def bench_transports(device: torch.device, b: int, vocab: int, repeats: int) -> dict:
    from dual_sampling.lockstep.row_channel import DeviceRows, HostRows, PinnedRows

    _, logits = rows(b, vocab, device)
    slots = list(range(b))
    shared = np.zeros((b, vocab), dtype=np.float32)
    channels = {"host": HostRows(shared)}
    if device.type == "cuda":
        channels["pinned"] = PinnedRows(np.zeros((b, vocab), dtype=np.float32), device)
        # In one process: the copies are those of two processes sharing the buffer through CUDA IPC.
        channels["device"] = DeviceRows(torch.empty(b, vocab, device=device))
    out = {}
    for name, channel in channels.items():

        def publish_and_read(channel=channel):
            channel.publish(slots, torch.log_softmax(logits, -1))
            channel.read(slots, device).sum()

        out[f"{name}_ms"] = median_ms(publish_and_read, device, repeats)
        channel.close()
    return out


def markdown(report: dict) -> str:
    lines = [
        f"Device: {report['device']} (torch {report['torch']}, Triton {report['triton']}); medians of "
        f"{report['repeats']} runs, ms per decoding step.",
        "",
        "| V | b | decide kl_symmetry | decide fixed | reference kl_symmetry | plain sampler | syncs | host | pinned "
        "| device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        t = r["transport"]
        lines.append(
            f"| {r['vocab']:,} | {r['batch']} | {r['decide_kl_symmetry_ms']:.3f} | {r['decide_fixed_ms']:.3f} | "
            f"{r['reference_kl_symmetry_ms']:.3f} | {r['plain_sampler_ms']:.3f} | {r['host_syncs_kl_symmetry']} | "
            f"{t.get('host_ms', float('nan')):.3f} | {t.get('pinned_ms', float('nan')):.3f} | "
            f"{t.get('device_ms', float('nan')):.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="bench-out/gpu-check.json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[151_936, 262_144])
    parser.add_argument("--smoke", action="store_true", help="the CPU, Triton's interpreter, tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
            return 2
        device = torch.device("cpu")
        args.batches, args.vocabs, args.repeats = [2], [600], 1
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --smoke (TRITON_INTERPRET=1) to check the script on the CPU")
        return 2
    else:
        device = torch.device("cuda")
    import triton

    if args.smoke:  # the GPU path on CPU tensors
        from dual_sampling.decision import fusable, pipeline

        fusable.kernel_device = pipeline.kernel_device = lambda _device: "cuda"
    checks = {"kernel": check_kernel(device, args.vocabs[0]), "transports": check_transports(device)}
    passed = all(c.get("ok", True) for group in checks.values() for c in group.values() if isinstance(c, dict))
    results = []
    for vocab in args.vocabs:
        for b in args.batches:
            figures = {"vocab": vocab, "batch": b, **bench_decision(device, b, vocab, args.repeats)}
            figures["transport"] = bench_transports(device, b, vocab, args.repeats)
            results.append(figures)
            print(json.dumps(figures), flush=True)
    at_64 = [r for r in results if r["batch"] == 64 and r["vocab"] == 151_936]
    derived = {}
    if at_64 and "device_ms" in at_64[0]["transport"]:
        added = at_64[0]["decide_kl_symmetry_ms"] + at_64[0]["transport"]["device_ms"]
        derived = {"added_ms_at_b64": added, "added_vs_7b_decode_floor": added / DECODE_FLOOR_MS}
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "repeats": args.repeats,
        "checks": checks,
        "checks_passed": passed,
        "results": results,
        "derived": derived,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"checks {'passed' if passed else 'FAILED'}: {json.dumps(checks)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
