"""``dual-sampling report``: PNG plots and a Markdown summary of a records file.

Plots: the distribution of α (teacher weight) over all tokens; mean α against token
position with its interquartile band; the distribution of the sequence log-weights
log w_θ = Σ(log π_θ − log q) and log w_t = Σ(log π_t − log q); response lengths.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from dual_sampling.records import effective_sample_size
from dual_sampling.run_output import open_no_follow, own_dir, write_no_follow

__all__ = ["load_records", "write_report"]


def load_records(path: str | Path) -> list[dict]:
    """Records written by ``dual-sampling generate`` (records format): a .jsonl or .parquet file, or a directory."""
    from dual_sampling.datagen.sinks import read_records

    records = read_records(str(path))
    if records and "alpha" not in records[0] and "sum_logq" in records[0]:
        raise ValueError(f"{path} holds a run of several teachers (an α column each): report plots one teacher's yet")
    if records and "alpha" not in records[0]:
        raise ValueError(f"{path} has no per-token alpha: report needs the 'records' format, not 'messages'")
    return records


def write_report(records_path: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write alpha_hist.png, alpha_by_position.png, log_weights.png, lengths.png and summary.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(records_path)
    if not records:
        raise ValueError(f"{records_path} holds no records")
    out = own_dir(Path(out_dir) if out_dir else Path(str(records_path) + ".report"))
    ok = [r for r in records if not r.get("error")]
    alphas = np.array([a for r in ok for a in r["alpha"]], dtype=float)
    lengths = np.array([r["num_tokens"] for r in records])
    log_w_theta = np.array([r["log_w_theta"] for r in ok])
    log_w_teacher = np.array([r["log_w_teacher"] for r in ok])
    style = {"color": "#3366aa", "edgecolor": "white"}

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(alphas, bins=50, range=(0, 1), **style)
    ax.axvline(alphas.mean(), color="#cc4422", label=f"mean {alphas.mean():.3f}")
    ax.set(xlabel="α (teacher weight)", ylabel="tokens", title=f"α over {alphas.size} generated tokens")
    ax.legend()
    _save(fig, out / "alpha_hist.png")

    longest = int(lengths.max())
    by_pos = [[r["alpha"][i] for r in ok if len(r["alpha"]) > i] for i in range(longest)]
    keep = [i for i, v in enumerate(by_pos) if len(v) >= 3] or [i for i, v in enumerate(by_pos) if v]
    pos = np.array(keep) + 1
    mean = np.array([statistics.fmean(by_pos[i]) for i in keep])
    q1 = np.array([np.percentile(by_pos[i], 25) for i in keep])
    q3 = np.array([np.percentile(by_pos[i], 75) for i in keep])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.fill_between(pos, q1, q3, color="#3366aa", alpha=0.25, label="interquartile range")
    ax.plot(pos, mean, color="#3366aa", label="mean")
    ax.set(
        xlabel="token position",
        ylabel="α (teacher weight)",
        ylim=(0, 1),
        title="α against position (positions with at least 3 sequences)",
    )
    ax.legend()
    _save(fig, out / "alpha_by_position.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.histogram_bin_edges(np.concatenate([log_w_theta, log_w_teacher]), bins=40)
    ax.hist(log_w_theta, bins=bins, alpha=0.6, color="#3366aa", label="log w_θ = Σ(log π_θ − log q)")
    ax.hist(log_w_teacher, bins=bins, alpha=0.6, color="#cc4422", label="log w_t = Σ(log π_t − log q)")
    ax.set(xlabel="sequence log-weight (nats)", ylabel="sequences", title="Importance log-weights")
    ax.legend()
    _save(fig, out / "log_weights.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=min(40, max(5, len(set(lengths.tolist())))), **style)
    ax.set(xlabel="generated tokens", ylabel="sequences", title="Response lengths")
    _save(fig, out / "lengths.png")

    sampling = records[0].get("sampling") or {}
    sampling = json.loads(sampling) if isinstance(sampling, str) else sampling  # JSON text in Parquet
    ess = effective_sample_size(log_w_theta.tolist())
    # A beam search's records are no samples of q: their weights weigh nothing.
    ess_line = (
        "none: the records are beams, not samples of q"
        if sampling.get("use_beam_search")
        else f"{ess:.1f} of {log_w_theta.size} ({ess / max(log_w_theta.size, 1):.1%})"
    )
    finish = {}
    for r in records:
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    lines = [
        f"# Report: {Path(records_path).name}",
        "",
        "| | |",
        "|---|---|",
        f"| samples | {len(records)} ({len(records) - len(ok)} with sync errors) |",
        f"| problems | {len({r['id'] for r in records})} |",
        f"| generated tokens | {int(lengths.sum())} (mean {lengths.mean():.1f}, max {longest}) |",
        f"| α mean ± std | {alphas.mean():.3f} ± {alphas.std():.3f} |",
        f"| α min / median / max | {alphas.min():.3f} / {np.median(alphas):.3f} / {alphas.max():.3f} |",
        f"| ESS of w_θ | {ess_line} |",
        f"| finish reasons | {json.dumps(finish)} |",
        "",
        "![alpha histogram](alpha_hist.png)",
        "![alpha by position](alpha_by_position.png)",
        "![log weights](log_weights.png)",
        "![lengths](lengths.png)",
        "",
    ]
    write_no_follow(out / "summary.md", "\n".join(lines))
    return out


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    with open_no_follow(path, "wb") as f:  # a link planted at a plot's name is refused, never written through
        fig.savefig(f, dpi=110, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)
