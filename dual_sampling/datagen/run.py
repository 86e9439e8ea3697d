"""Distillation data-generation runs: dataset in, one training-ready record per sample out.

A run reads problems (JSONL, Parquet, or a local Hugging Face ``datasets`` folder), renders
a teacher prompt (problem plus the reference solution as a hint) and a theta prompt
(problem only), samples from the dual engine, and writes one record per
(id, sample_index).

Crash safety
------------
- One run writes an output at a time: it holds an exclusive lock on ``OUT.lock`` from start
  to end, and a second run on the same output fails at once, naming both.
- Records go to a JSONL journal, one whole line per record, flushed and fsync'd after
  every batch. For ``.jsonl`` output the journal *is* the output; for ``.parquet`` output the
  journal is ``OUT.journal.jsonl`` and the Parquet file is written (atomically) at the end.
- ``OUT.manifest.json`` holds the run configuration, its hash and the SHA-256 of every input
  file. ``--resume`` refuses a different configuration (naming the differing keys) or a
  changed input (naming the file), then skips every (id, sample_index) already in the
  journal. A torn last line (a kill mid-write) is cut off, not read as data.
- Sample seeds derive from (seed, id, sample_index), so a resumed sample is drawn with the
  same seed as it would have been in an uninterrupted run.

Runs of any size
----------------
No step holds the input or the records: the input is read a batch at a time, twice (to check every
row, then to plan and draw); a resume reads only the (id, sample_index) keys; a batch is committed
in time proportional to it; a Parquet file is written from its journal a row group at a time. What
grows with a run is its ids and keys, and one float per sample (for the ESS).

Only complete, verified samples with finite numbers are training data: a sample that
failed (or was aborted, or has a non-finite α, log π or log q) goes to ``OUT.failed.jsonl``
with its error, never to the output, and is drawn again by ``--resume``. The summary counts
failures by their error code. No JSON a run writes holds NaN or infinity.

This module only orchestrates: it runs the parts (``inputs``, ``manifest``, ``plan``, ``draw`` or
``ray_stage``, ``sinks``) in order and counts the summary.
"""

from __future__ import annotations

import array
import collections
import json
import math
import time
from pathlib import Path
from typing import Any

from dual_sampling import start_engine_server_early

# ray_stage imports Ray (optional and heavy) only inside its functions, so a run without --ray never loads it.
from dual_sampling.datagen import ray_stage
from dual_sampling.datagen.draw import Outcome, sample_here
from dual_sampling.datagen.durable import write_text_durably
from dual_sampling.datagen.inputs import input_fingerprint, iter_rows, iter_selected, model_fingerprints
from dual_sampling.datagen.manifest import check_manifest
from dual_sampling.datagen.plan import iter_items
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.sinks import Journal, open_sink, output_lock, output_paths, write_rejects
from dual_sampling.options import context_length
from dual_sampling.records import effective_sample_size
from dual_sampling.text import engine_tokenizer

__all__ = ["run_generation"]


def run_generation(cfg: RunConfig, sampler=None) -> dict[str, Any]:
    """Run (or resume) a data-generation run; return its summary (also written to the summary file).

    ``sampler`` is an open :class:`OptimalSamplingDual` on the same models to reuse; by default
    one is started and closed here. With ``cfg.ray`` the samples are drawn by Ray Data
    replicas (``dual_sampling.datagen.ray_stage``) and this process only plans, writes and counts.
    """
    started = time.monotonic()
    paths = output_paths(cfg)
    with output_lock(cfg, paths):
        return _run(cfg, sampler, paths, started)


def _run(cfg: RunConfig, sampler: Any, paths: dict[str, Path], started: float) -> dict[str, Any]:
    # A first pass checks every row (fields, unique ids) before anything is written; the second, below, plans and
    # draws batch by batch. Neither holds the input. The first pass and the cluster's address are checked before
    # transformers and vLLM load, so bad input is named in a second, not after their imports.
    rejects: list[dict] = []
    selected = sum(1 for _ in iter_selected(cfg, iter_rows(cfg.input), rejects))
    if cfg.ray:
        ray_stage.check_cluster_address()
    elif sampler is None:  # the engines' fork server imports vLLM beside this process's own imports below
        start_engine_server_early()
    from transformers import AutoTokenizer

    inputs = input_fingerprint(cfg.input)
    models = model_fingerprints(cfg)
    folders = cfg.source.folders
    if sampler is not None:  # before the manifest: a refused run writes nothing
        running = {model.name: model.folder for model in sampler.config.model_engines()}
        if list(running) != list(folders):
            raise ValueError(f"the sampler runs the models {list(running)} but the run configures {list(folders)}")
        for name, wanted in folders.items():
            if Path(wanted).resolve() != Path(running[name]).resolve():
                raise ValueError(f"the sampler runs {name} {running[name]!r} but the run configures {wanted!r}")
        # Every record names the run's α method and options: the sampler must decide with those.
        deciding = getattr(sampler, "alpha_settings", None)  # None: a stand-in without engines
        configured = (cfg.engine.alpha_method, cfg.engine.alpha_kwargs)
        if deciding is not None and (deciding[0], dict(deciding[1])) != configured:
            raise ValueError(
                f"alpha_method/alpha_config: the sampler decides with {deciding[0]!r} {dict(deciding[1])} but the run "
                f"configures {configured[0]!r} {configured[1]}; its records would name the run's"
            )
    check_manifest(cfg, paths, models, inputs)
    sink = open_sink(paths, cfg.resume, cfg.format, cfg.roster)
    logs: list[Journal] = []
    try:
        for name in ("failed", "truncated"):
            logs.append(Journal(paths[name], cfg.resume))
        writer = _Writer(sink, *logs)
        already = len(sink.done) + len(writer.left_out.done)
        # Every engine tokenizes with the first teacher's tokenizer (DualEngineConfig.tokenizer_folder).
        first_teacher = folders[cfg.source.roster.teachers[0]]
        if sampler is not None:
            tokenizer = sampler.tokenizer
        elif cfg.ray:  # the driver plans without importing vLLM; its replicas sample
            tokenizer = AutoTokenizer.from_pretrained(first_teacher)
        else:  # the engines' own, shared with the sampler this run starts (one load)
            tokenizer = engine_tokenizer(first_teacher)
        max_model_len = context_length(tuple(folders.values()), cfg.engine.max_model_len)
        rows = iter_selected(cfg, iter_rows(cfg.input), [], unique=False)  # its rejects were counted above
        too_long: list[dict] = []
        items = iter_items(cfg, rows, _Done(sink.done, writer.left_out.done), tokenizer, max_model_len, too_long)
        if cfg.ray:
            sync = ray_stage.sample_on_ray(cfg, items, models, writer.commit)
        else:
            total = max(selected * cfg.sampling.n - already, 0)
            sync = sample_here(cfg, items, models, sampler, writer.commit, total)
        rejects += too_long
        write_rejects(paths["rejects"], rejects)
        sink.finish()
        for log in logs:
            log.close()
            if not log.path.stat().st_size:
                log.path.unlink()
        summary = writer.tally.summary(cfg, already, rejects, sync, time.monotonic() - started)
        write_text_durably(paths["summary"], json.dumps(summary, indent=1, allow_nan=False) + "\n")
        return summary
    finally:
        sink.close()
        for log in logs:
            log.close()


class _Done:
    """(id, sample_index) pairs done: in the sink or left out. Asks each set in turn; a union would copy them."""

    def __init__(self, *done: set) -> None:
        self.done = done

    def __contains__(self, key: object) -> bool:
        return any(key in d for d in self.done)


class _Writer:
    """Where a batch of outcomes goes: records to the sink (once each), failures and left-out answers to their logs,
    numbers to the tally."""

    def __init__(self, sink: Any, failed: Journal, left_out: Journal) -> None:
        self.sink, self.failed, self.left_out, self.tally = sink, failed, left_out, _Tally()

    def commit(self, outcomes: list[Outcome]) -> None:
        fresh = self.sink.write([o.record for o in outcomes if o.record is not None])
        fresh += self.left_out.write([o.left_out for o in outcomes if o.left_out is not None])
        self.failed.write([o.failure for o in outcomes if o.failure is not None], unique=False)
        fresh_keys = {(r["id"], r["sample_index"]) for r in fresh}
        for o in outcomes:
            self.tally.add(o, new=(o.id, o.sample_index) in fresh_keys)


class _Tally:
    """The run summary's numbers, kept as running sums (one float per sample for the ESS)."""

    def __init__(self) -> None:
        self.written = self.tokens = self.alpha_n = self.truncated = self.left_out = 0
        self.alpha_sum = self.alpha_sq = 0.0
        self.log_w = array.array("d")  # 8 bytes a sample, for the ESS at the end
        self.failures: collections.Counter = collections.Counter()
        self.teacher_sums: collections.Counter = collections.Counter()  # several teachers: Σα by alpha column

    def add(self, outcome: Outcome, new: bool = True) -> None:
        if outcome.failure is not None:
            self.failures[
                (outcome.failure.get("error") or outcome.failure.get("finish_reason") or "unknown").split(" at ")[0]
            ] += 1
            return
        if not new:
            return  # a retried batch repeated a sample already counted
        if outcome.left_out is not None:
            self.left_out += 1
            return
        s = outcome.stats
        self.written += 1
        self.truncated += int(s["truncated"])
        self.tokens += int(s["tokens"])
        self.alpha_n += int(s["tokens"])
        self.alpha_sum += s["alpha_sum"]
        self.alpha_sq += s["alpha_sq"]
        self.log_w.append(s["log_w_theta"])
        self.teacher_sums.update({k[len("sum_") :]: v for k, v in s.items() if k.startswith("sum_alpha")})

    def _by_teacher(self, cfg: RunConfig) -> dict[str, Any]:
        """Several teachers: ``alpha_mean_by_teacher`` (each teacher's mean α, None before any token); else nothing."""
        if len(cfg.roster.teachers) == 1:
            return {}
        means = {
            t: self.teacher_sums[column] / self.alpha_n if self.alpha_n else None
            for t, column in zip(cfg.roster.teachers, cfg.roster.alpha_columns)
        }
        return {"alpha_mean_by_teacher": means}

    @property
    def alpha_mean(self) -> float | None:
        return self.alpha_sum / self.alpha_n if self.alpha_n else None

    def summary(self, cfg: RunConfig, already: int, rejects: list[dict], sync: dict, wall: float) -> dict[str, Any]:
        """Counts, α statistics, the ESS of the θ-weights, failures by error code, sync statistics, wall time.

        ``truncated_samples`` counts the answers cut off at max_tokens that were written, ``truncated_left_out`` those
        left out (format "messages" without keep_truncated). A beam search's records are no samples of q, so the
        ESS of their weights means nothing: None there. With several teachers ``alpha_mean`` and ``alpha_std`` are of
        the total teacher weight Σα at each token, and ``alpha_mean_by_teacher`` holds each teacher's mean α."""
        mean = self.alpha_mean
        ess = effective_sample_size(self.log_w) if self.log_w and not cfg.sampling.use_beam_search else None
        return {
            "output": cfg.output,
            "samples_written": self.written,
            "samples_already_done": already,
            "failed_samples": sum(self.failures.values()),
            "failures": dict(sorted(self.failures.items())),
            "truncated_samples": self.truncated,
            "truncated_left_out": self.left_out,
            "rejected_prompts": len(rejects),
            "generated_tokens": self.tokens,
            "alpha_mean": mean,
            "alpha_std": math.sqrt(max(self.alpha_sq / self.alpha_n - mean * mean, 0.0)) if self.alpha_n else None,
            **self._by_teacher(cfg),
            "ess_theta_weights": ess,
            "ess_fraction": ess / len(self.log_w) if ess else None,
            "sync": sync,
            "wall_seconds": wall,
        }
