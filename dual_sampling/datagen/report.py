"""``dual-sampling report``: PNG plots and a Markdown summary of a records file.

Plots: the distribution of α (teacher weight) over all tokens; mean α against token
position with its interquartile band; the distribution of the sequence log-weights
log w_θ = Σ(log π_θ − log q) and log w_t = Σ(log π_t − log q); response lengths.

A run of several teachers (records with an ``alpha_<teacher>`` column each) is reported on the total teacher weight
Σα at each token, with each teacher's α beside it, and a log weight ``log_w_<model>`` per model.
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
    if records and not _alpha_columns(records[0]):
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
    columns = _alpha_columns(records[0])
    several = len(columns) > 1
    total = [np.sum([r[c] for c in columns], axis=0, dtype=float) for r in ok]  # Σα at each token, per record
    alphas = np.concatenate(total) if total else np.zeros(0)
    lengths = np.array([r["num_tokens"] for r in records])
    log_w = {key[len("log_w_") :]: np.array([r[key] for r in ok]) for key in records[0] if key.startswith("log_w_")}
    log_w_theta = log_w["theta"]
    style = {"color": "#3366aa", "edgecolor": "white"}
    what = "Σα (total teacher weight)" if several else "α (teacher weight)"
    label = what if several else "α"  # the summary's rows, as a pair's report has always named them

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(alphas, bins=50, range=(0, 1), **style)
    ax.axvline(alphas.mean(), color="#cc4422", label=f"mean {alphas.mean():.3f}")
    for column in columns if several else ():
        values = np.concatenate([np.asarray(r[column], dtype=float) for r in ok])
        ax.hist(values, bins=50, range=(0, 1), histtype="step", label=f"{column} (mean {values.mean():.3f})")
    ax.set(xlabel=what, ylabel="tokens", title=f"{what} over {alphas.size} generated tokens")
    ax.legend()
    _save(fig, out / "alpha_hist.png")

    longest = int(lengths.max())
    by_pos = [[t[i] for t in total if len(t) > i] for i in range(longest)]
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
        ylabel=what,
        ylim=(0, 1),
        title=f"{what.split(' ')[0]} against position (positions with at least 3 sequences)",
    )
    ax.legend()
    _save(fig, out / "alpha_by_position.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.histogram_bin_edges(np.concatenate(list(log_w.values())), bins=40)
    for name, values in log_w.items():
        shown = {"theta": "θ", "teacher": "t"}.get(name, name)
        ax.hist(values, bins=bins, alpha=0.6, label=f"log w_{shown} = Σ(log π_{shown} − log q)")
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
        f"| {label} mean ± std | {alphas.mean():.3f} ± {alphas.std():.3f} |",
        f"| {label} min / median / max | {alphas.min():.3f} / {np.median(alphas):.3f} / {alphas.max():.3f} |",
        *(
            f"| {column} mean | {np.mean(np.concatenate([np.asarray(r[column], dtype=float) for r in ok])):.3f} |"
            for column in (columns if several else ())
        ),
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


def _alpha_columns(record: dict) -> list[str]:
    """The record's per-token α columns: ``alpha`` for one teacher, ``alpha_<teacher>`` for each of several
    (:attr:`~dual_sampling.roster.Roster.alpha_columns`); none in a ``messages`` record."""
    return [k for k, v in record.items() if (k == "alpha" or k.startswith("alpha_")) and isinstance(v, list)]


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    with open_no_follow(path, "wb") as f:  # a link planted at a plot's name is refused, never written through
        fig.savefig(f, dpi=110, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)
