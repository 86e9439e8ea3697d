"""Distillation data-generation runs: dataset in, one training-ready record per sample out.

A run reads problems (JSONL, Parquet, or a local Hugging Face ``datasets`` folder), renders
a teacher prompt (problem plus the reference solution as a hint) and a theta prompt
(problem only), samples from the dual engine, and writes one record per
(id, sample_index).

Crash safety
------------
- Records go to a JSONL journal, one whole line per record, flushed and fsync'd after
  every batch. For ``.jsonl`` output the journal *is* the output; for ``.parquet`` output the
  journal is ``OUT.journal.jsonl`` and the Parquet file is written (atomically) at the end.
- ``OUT.manifest.json`` holds the run configuration and its hash. ``--resume`` refuses a
  different configuration and names the differing keys, then skips every (id, sample_index)
  already in the journal. A torn last line (a kill mid-write) is cut off, not read as data.
- Sample seeds derive from (seed, id, sample_index), so a resumed sample is drawn with the
  same seed as it would have been in an uninterrupted run.

Only complete, verified samples are training data: a sample that failed (or was
aborted) goes to ``OUT.failed.jsonl`` with its error, never to the output, and is drawn
again by ``--resume``. The summary counts failures by their error code.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dual_sampling.config import EngineOptions, SamplingOptions
from dual_sampling.outputs import effective_sample_size

__all__ = [
    "DEFAULT_TEACHER_TEMPLATE",
    "DEFAULT_THETA_TEMPLATE",
    "RunConfig",
    "load_rows",
    "model_fingerprint",
    "read_journal",
    "run_generation",
    "shard_of",
    "user_template",
]

DEFAULT_TEACHER_TEMPLATE = (
    "{{ problem }}{% if hint %}\n\nA reference solution follows. Use it as a hint, and write your own complete "
    "answer.\n\n{{ hint }}{% endif %}"
)
DEFAULT_THETA_TEMPLATE = "{{ problem }}"

# Settings that do not change what a record contains (so --resume may change them).
_NOT_IDENTITY = {
    "resume",
    "batch_size",
    "use_tqdm",
    "output",
    "sync_timeout",
    "max_num_seqs",
    "max_num_batched_tokens",
    "cpu_binding",
    "enforce_eager",
    "enable_prefix_caching",
    "kv_cache_memory_bytes",
}


@dataclass
class RunConfig:
    """One data-generation run.

    It composes :class:`SamplingOptions` (how to sample) and :class:`EngineOptions` (how to
    run the engines). On the command line and in ``--config run.yaml`` every field of all
    three is one flat key (``--max-tokens 128``, ``alpha_method: ess_balance``); see
    :meth:`from_settings`.
    """

    input: str
    """Problems: a .jsonl or .parquet file, or a local Hugging Face datasets folder."""
    output: str
    """Records: a .jsonl or .parquet file."""
    teacher: str | None = None
    """Teacher model folder; None: the local SmolLM2-135M-Instruct."""
    theta: str | None = None
    """Theta (student) model folder, same tokenizer as the teacher; None: the 24-layer pruned SmolLM2."""
    prompt_field: str = "problem"
    """Field holding the problem text."""
    hint_field: str | None = None
    """Field holding the reference solution shown to the teacher only (e.g. "solution")."""
    id_field: str | None = None
    """Field holding a unique id; None uses the row number."""
    chat_template: bool = True
    """Wrap prompts in each model's chat template; False for base models."""
    system_prompt_teacher: str | None = None
    """System message for the teacher's chat."""
    system_prompt_theta: str | None = None
    """System message for theta's chat."""
    teacher_template: str | None = None
    """Jinja template (string or file) of the teacher's user message; sees problem, hint, row."""
    theta_template: str | None = None
    """Jinja template (string or file) of theta's user message; sees problem, hint, row."""
    format: str = "records"
    """"records" (everything) or "messages" (a TRL-ready chat view)."""
    shard: str = "0/1"
    """"i/N": this machine's deterministic share of the dataset."""
    resume: bool = False
    """Continue an interrupted run in place (failed samples are drawn again)."""
    batch_size: int = 32
    """Problems per generate() call; records are fsync'd after each."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """How to sample; its fields are flat keys of the run (n, max_tokens, temperature, seed, ...)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """How to run the engines; its fields are flat keys of the run (alpha_method, max_num_seqs, ...)."""

    def __post_init__(self) -> None:
        if self.teacher is None or self.theta is None:
            from dual_sampling import models

            self.teacher = self.teacher or str(models.smollm2())
            self.theta = self.theta or str(models.smollm2_pruned())
        if self.format not in ("records", "messages"):
            raise ValueError(f"format must be 'records' or 'messages', got {self.format!r}")
        if Path(self.output).suffix not in (".jsonl", ".parquet"):
            raise ValueError(f"output must end in .jsonl or .parquet, got {self.output!r}")
        self.shard_index, self.shard_count = _parse_shard(self.shard)
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> RunConfig:
        """Build from flat keys (CLI flags, run.yaml): each goes to the run, its sampling or its engine options."""
        parts: dict[str, dict[str, Any]] = {"run": {}, "sampling": {}, "engine": {}}
        for key, value in settings.items():
            part = _FLAT_KEYS.get(key)
            if part is None:
                raise ValueError(f"unknown setting {key!r}; known: {sorted(_FLAT_KEYS)}")
            parts[part][key] = value
        return cls(
            **parts["run"], sampling=SamplingOptions(**parts["sampling"]), engine=EngineOptions(**parts["engine"])
        )

    def flat(self) -> dict[str, Any]:
        """Every setting as one flat mapping (the inverse of :meth:`from_settings`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("sampling", "engine")}
        return {**out, **dataclasses.asdict(self.sampling), **dataclasses.asdict(self.engine)}

    def identity(self) -> dict[str, Any]:
        """The settings that decide what the records contain (compared on --resume)."""
        return {k: v for k, v in self.flat().items() if k not in _NOT_IDENTITY}


_FLAT_KEYS = {
    **{f.name: "run" for f in dataclasses.fields(RunConfig) if f.name not in ("sampling", "engine")},
    **{f.name: "sampling" for f in dataclasses.fields(SamplingOptions)},
    **{f.name: "engine" for f in dataclasses.fields(EngineOptions)},
}
"""Which part of a run each flat key belongs to."""


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"shard must look like 'i/N', got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard must satisfy 0 <= i < N, got {text!r}")
    return i, n


def shard_of(row_id: str, count: int) -> int:
    """The shard (0..count-1) a row id belongs to: stable across machines and row orders."""
    return int.from_bytes(hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "little") % count


def load_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .parquet file or a local datasets folder, as dicts."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input {path!r} does not exist")
    if p.is_dir():
        try:
            from datasets import DatasetDict, load_from_disk
        except ImportError:
            raise ImportError(
                "reading a datasets folder needs the 'datasets' package: pip install 'dual-sampling[data]'"
            ) from None
        data = load_from_disk(str(p))
        if isinstance(data, DatasetDict):
            raise ValueError(
                f"{path!r} is a DatasetDict with splits {list(data.keys())}; point --input at one split's folder"
            )
        return [dict(r) for r in data]
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    rows = []
    with p.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number} is not valid JSON: {exc.msg}") from None
    return rows


def model_fingerprint(folder: str) -> dict[str, str]:
    """Path and a content hash (BLAKE2b over the config, tokenizer and weight files) of a model folder."""
    h = hashlib.blake2b(digest_size=16)
    root = Path(folder)
    for f in sorted(root.iterdir()):
        if f.is_file() and (
            f.suffix in (".json", ".safetensors", ".bin", ".model", ".txt") or f.name == "tokenizer.json"
        ):
            h.update(f.name.encode())
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
    return {"path": str(root.resolve()), "blake2b": h.hexdigest()}


# ---------------------------------------------------------------------- journal


def read_journal(path: Path, repair: bool = True) -> list[dict[str, Any]]:
    """Records of a JSONL journal. A torn last line (no newline, or not JSON) is cut off when
    ``repair``; a bad line anywhere else is corruption and raises ValueError naming it."""
    if not path.exists():
        return []
    data = path.read_bytes()
    keep = len(data)
    lines = data.split(b"\n")
    tail = lines.pop()  # bytes after the last newline: empty unless the last line is torn
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not tail:
                keep = len(data) - len(line) - 1
                break
            raise ValueError(f"{path}:{number} is not a complete JSON record; the file is damaged") from None
    if tail:
        keep = min(keep, len(data) - len(tail))
    if keep < len(data):
        if not repair:
            raise ValueError(f"{path} ends in a torn record")
        with path.open("r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return records


class _Journal:
    """Append-only JSONL with one fsync per batch."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


# ---------------------------------------------------------------------- prompts


def user_template(text: str | None, default: str):
    """A compiled Jinja template of a user message (``text``: a template string, a file, or None for ``default``)."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(_template_text(text) or default)


class _Renderer:
    def __init__(self, cfg: RunConfig, tokenizer) -> None:
        self.teacher = user_template(cfg.teacher_template, DEFAULT_TEACHER_TEMPLATE)
        self.theta = user_template(cfg.theta_template, DEFAULT_THETA_TEMPLATE)
        self.cfg, self.tokenizer = cfg, tokenizer

    def user_messages(self, problem: str, hint: str | None, row: dict) -> tuple[str, str]:
        return (
            self.teacher.render(problem=problem, hint=hint, row=row),
            self.theta.render(problem=problem, hint=hint, row=row),
        )

    def prompt(self, user: str, system: str | None) -> str:
        if not self.cfg.chat_template:
            return user if system is None else f"{system}\n\n{user}"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _template_text(value: str | None) -> str | None:
    if value is None:
        return None
    p = Path(value)
    if len(value) < 4096 and "{" not in value and p.is_file():
        return p.read_text(encoding="utf-8")
    return value


# ---------------------------------------------------------------------- run


@dataclass
class _Item:
    id: str
    teacher_user: str
    theta_user: str
    teacher_prompt: str
    theta_prompt: str
    missing: list[int]


def _prepare(cfg: RunConfig, rows: list[dict], renderer: _Renderer) -> tuple[list[tuple[int, dict, str]], list[dict]]:
    """(row number, row, id) of this shard's rows, and the rows rejected before generation."""
    selected, seen, rejects = [], {}, []
    for number, row in enumerate(rows):
        for name in (cfg.prompt_field, cfg.hint_field, cfg.id_field):
            if name is not None and name not in row:
                raise ValueError(f"row {number} has no field {name!r} (fields: {sorted(row)})")
        row_id = str(row[cfg.id_field]) if cfg.id_field else str(number)
        if row_id in seen:
            raise ValueError(f"rows {seen[row_id]} and {number} share the id {row_id!r}")
        seen[row_id] = number
        if shard_of(row_id, cfg.shard_count) != cfg.shard_index:
            continue
        problem = row[cfg.prompt_field]
        if not isinstance(problem, str) or not problem.strip():
            rejects.append({"id": row_id, "row": number, "reason": "empty prompt"})
            continue
        selected.append((number, row, row_id))
    return selected, rejects


def _paths(cfg: RunConfig) -> dict[str, Path]:
    out = Path(cfg.output)
    journal = out if out.suffix == ".jsonl" else out.with_name(out.name + ".journal.jsonl")
    return {
        "output": out,
        "journal": journal,
        "manifest": out.with_name(out.name + ".manifest.json"),
        "rejects": out.with_name(out.stem + ".rejects.jsonl"),
        "failed": out.with_name(out.stem + ".failed.jsonl"),
        "summary": out.with_name(out.name + ".summary.json"),
    }


def _check_manifest(cfg: RunConfig, paths: dict[str, Path], models: dict) -> None:
    identity = {**cfg.identity(), "models": models}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    manifest = paths["manifest"]
    if cfg.resume and manifest.exists():
        old = json.loads(manifest.read_text())
        if old["config_hash"] != digest:
            now = json.loads(json.dumps(identity))
            changed = sorted(k for k in set(old["config"]) | set(now) if old["config"].get(k) != now.get(k))
            details = "; ".join(f"{k}: {old['config'].get(k)!r} -> {identity.get(k)!r}" for k in changed)
            raise ValueError(f"refusing to resume {cfg.output}: the configuration differs ({details})")
        return
    if not cfg.resume and any(paths[k].exists() for k in ("output", "journal", "manifest")):
        raise FileExistsError(
            f"{cfg.output} (or its journal or manifest) already exists; pass --resume to continue it, "
            "or remove it to start over"
        )
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_name(manifest.name + ".tmp")
    tmp.write_text(
        json.dumps({"config_hash": digest, "config": identity, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1)
        + "\n"
    )
    os.replace(tmp, manifest)


def _record(cfg: RunConfig, item: _Item, j: int, sample, models: dict) -> dict[str, Any]:
    if cfg.format == "messages":
        messages = [{"role": "system", "content": cfg.system_prompt_theta}] if cfg.system_prompt_theta else []
        messages += [{"role": "user", "content": item.theta_user}, {"role": "assistant", "content": sample.text}]
        return {"id": item.id, "sample_index": j, "messages": messages}
    engine = cfg.engine
    return {
        "id": item.id,
        "sample_index": j,
        "seed": sample.seed,
        "teacher_prompt": item.teacher_prompt,
        "theta_prompt": item.theta_prompt,
        "response": sample.text,
        "token_ids": sample.token_ids,
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason,
        "error": sample.error,
        "num_tokens": len(sample.token_ids),
        "alpha": sample.alpha,
        "logp_teacher": sample.logp_teacher,
        "logp_theta": sample.logp_theta,
        "logq": sample.logq,
        "sum_alpha": math.fsum(sample.alpha),
        "sum_logp_teacher": math.fsum(sample.logp_teacher),
        "sum_logp_theta": math.fsum(sample.logp_theta),
        "sum_logq": math.fsum(sample.logq),
        "log_w_theta": sample.log_w_theta,
        "log_w_teacher": sample.log_w_teacher,
        "models": models,
        # Parquet has no empty struct: logit_bias is stored as [token id, bias] pairs.
        "sampling": {
            **dataclasses.asdict(cfg.sampling),
            "logit_bias": [[t, b] for t, b in cfg.sampling.logit_bias.items()],
        },
        "alpha_config": {
            "method": engine.alpha_method,
            "alpha_min": engine.alpha_min,
            "alpha_max": engine.alpha_max,
            **engine.alpha_config,
        },
    }


def _failure(item: _Item, j: int, sample) -> dict[str, Any]:
    """What a failed sample leaves behind: enough to see why, nothing to train on."""
    return {
        "id": item.id,
        "sample_index": j,
        "seed": sample.seed,
        "finish_reason": sample.finish_reason,
        "error": sample.error,
        "num_tokens": len(sample.token_ids),
    }


def run_generation(cfg: RunConfig, sampler=None) -> dict[str, Any]:
    """Run (or resume) a data-generation run; return its summary (also written to OUT.summary.json).

    ``sampler`` is an open :class:`OptimalSamplingDual` on the same models to reuse; by default
    one is started and closed here.
    """
    from tqdm.auto import tqdm

    from dual_sampling.engine import OptimalSamplingDual

    started = time.monotonic()
    paths = _paths(cfg)
    rows = load_rows(cfg.input)
    models = {"teacher": model_fingerprint(cfg.teacher), "theta": model_fingerprint(cfg.theta)}
    _check_manifest(cfg, paths, models)
    done_records = read_journal(paths["journal"]) if cfg.resume else []
    done = {(r["id"], r["sample_index"]) for r in done_records}

    own = sampler is None
    if not own:
        for role, wanted, running in (
            ("teacher", cfg.teacher, sampler.config.model_teacher),
            ("theta", cfg.theta, sampler.config.model_theta),
        ):
            if Path(wanted).resolve() != Path(running).resolve():
                raise ValueError(f"the sampler runs {role} {running!r} but the run configures {wanted!r}")
    if own:
        sampler = OptimalSamplingDual(cfg.teacher, cfg.theta, **{**dataclasses.asdict(cfg.engine), "use_tqdm": False})
    journal = failed_log = None
    try:
        renderer = _Renderer(cfg, sampler.tokenizer)
        selected, rejects = _prepare(cfg, rows, renderer)
        items = []
        for number, row, row_id in selected:
            missing = [j for j in range(cfg.sampling.n) if (row_id, j) not in done]
            if not missing:
                continue
            hint = None if cfg.hint_field is None else row[cfg.hint_field]
            t_user, th_user = renderer.user_messages(row[cfg.prompt_field], hint, row)
            item = _Item(
                row_id,
                t_user,
                th_user,
                renderer.prompt(t_user, cfg.system_prompt_teacher),
                renderer.prompt(th_user, cfg.system_prompt_theta),
                missing,
            )
            longest = max(
                len(sampler.tokenizer(p, add_special_tokens=True)["input_ids"])
                for p in (item.teacher_prompt, item.theta_prompt)
            )
            if longest + 1 > sampler.max_model_len:
                rejects.append(
                    {
                        "id": row_id,
                        "row": number,
                        "reason": f"prompt has {longest} tokens; max_model_len is {sampler.max_model_len}",
                    }
                )
                continue
            items.append(item)
        _write_rejects(paths["rejects"], rejects)

        journal, failed_log = _Journal(paths["journal"]), _Journal(paths["failed"])
        written, failed = [], []  # SampleRecords of this invocation, for the summary
        tokens = 0
        bar = tqdm(
            total=sum(len(i.missing) for i in items), desc="samples", unit="sample", disable=not cfg.engine.use_tqdm
        )
        generating = time.monotonic()
        for start in range(0, len(items), cfg.batch_size):
            batch = items[start : start + cfg.batch_size]
            out = sampler.generate(
                [i.theta_prompt for i in batch],
                teacher_prompts=[i.teacher_prompt for i in batch],
                prompt_keys=[i.id for i in batch],
                sampling=cfg.sampling,
                use_tqdm=False,
            )
            pairs = [(item, j, req.samples[j]) for item, req in zip(batch, out.requests) for j in item.missing]
            # Only complete, verified samples are training data; a failed one is logged and drawn again on --resume.
            journal.write(_record(cfg, item, j, sample, models) for item, j, sample in pairs if sample.ok)
            failed_log.write(_failure(item, j, sample) for item, j, sample in pairs if not sample.ok)
            written += [sample for _, _, sample in pairs if sample.ok]
            failed += [sample for _, _, sample in pairs if not sample.ok]
            tokens += sum(len(sample.token_ids) for _, _, sample in pairs)
            alphas = [a for s in written for a in s.alpha]
            bar.set_postfix(
                tok_s=f"{tokens / max(time.monotonic() - generating, 1e-9):.1f}",
                mean_alpha=f"{statistics.fmean(alphas):.3f}" if alphas else "-",
                failed=len(failed),
            )
            bar.update(len(pairs))
        bar.close()
        journal.close()
        failed_log.close()
        journal = failed_log = None
        if not paths["failed"].stat().st_size:
            paths["failed"].unlink()
        if paths["output"].suffix == ".parquet":
            _write_parquet(paths["journal"], paths["output"])
        summary = _summary(
            cfg, written, failed, len(done), rejects, sampler.get_sync_statistics(), time.monotonic() - started
        )
        paths["summary"].write_text(json.dumps(summary, indent=1) + "\n")
        return summary
    finally:
        for log in (journal, failed_log):
            if log is not None:
                log.close()
        if own:
            sampler.close()


def _write_rejects(path: Path, rejects: list[dict]) -> None:
    """Rejects follow from the dataset and configuration alone, so each invocation rewrites them whole."""
    if not rejects:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects), encoding="utf-8")
    os.replace(tmp, path)


def _write_parquet(journal: Path, output: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(read_journal(journal))
    tmp = output.with_name(output.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, output)


def _summary(
    cfg: RunConfig, samples: list, failed: list, already: int, rejects: list[dict], sync: dict, wall: float
) -> dict:
    """Counts, α statistics, the ESS of the θ-weights, failures by error code, sync statistics, wall time."""
    alphas = [a for s in samples for a in s.alpha]
    log_w = [s.log_w_theta for s in samples]
    ess = effective_sample_size(log_w) if log_w else None
    failures = collections.Counter((s.error or s.finish_reason or "unknown").split(" at ")[0] for s in failed)
    return {
        "output": cfg.output,
        "samples_written": len(samples),
        "samples_already_done": already,
        "failed_samples": len(failed),
        "failures": dict(sorted(failures.items())),
        "rejected_prompts": len(rejects),
        "generated_tokens": sum(len(s.token_ids) for s in samples),
        "alpha_mean": statistics.fmean(alphas) if alphas else None,
        "alpha_std": statistics.pstdev(alphas) if alphas else None,
        "ess_theta_weights": ess,
        "ess_fraction": ess / len(log_w) if ess else None,
        "sync": sync,
        "wall_seconds": wall,
    }
