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
    "select_rows",
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
    "ray",
    "replicas",
    "cpus_per_replica",
    "gpus_per_replica",
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
    """Records: a .jsonl or .parquet file, or a directory (Parquet parts, for runs of any size)."""
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
    """Problems per generate() call (with --ray: per replica batch); records are fsync'd after each."""
    ray: bool = False
    """Draw the samples on a Ray cluster (RAY_ADDRESS, or a local one started for the run) with Ray Data."""
    replicas: int = 1
    """With --ray: dual engines running at once, one per Ray actor."""
    cpus_per_replica: float = 2.0
    """With --ray: CPUs each replica reserves (its two engines' model threads share them)."""
    gpus_per_replica: float = 0.0
    """With --ray: GPUs each replica reserves (2 puts each engine on its own GPU)."""
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
        if Path(self.output).suffix not in (".jsonl", ".parquet", ""):
            raise ValueError(f"output must be a .jsonl or .parquet file, or a directory, got {self.output!r}")
        self.shard_index, self.shard_count = _parse_shard(self.shard)
        for name in ("batch_size", "replicas"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("cpus_per_replica", "gpus_per_replica"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))
            if not (isinstance(getattr(self, name), float) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")

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
class WorkItem:
    """One problem to sample: both rendered prompts, and the sample indices still missing."""

    id: str
    teacher_user: str
    theta_user: str
    teacher_prompt: str
    theta_prompt: str
    missing: list[int]


@dataclass
class Outcome:
    """What one drawn sample leaves: a record (training data) or a failure, and its numbers for the summary."""

    id: str
    sample_index: int
    record: dict[str, Any] | None
    failure: dict[str, Any] | None
    stats: dict[str, float]
    """tokens, alpha_sum, alpha_sq, log_w_theta: what the run summary needs, whatever the format."""


def select_rows(cfg: RunConfig, rows: list[dict]) -> tuple[list[tuple[int, dict, str]], list[dict]]:
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


def plan_items(
    cfg: RunConfig, selected: list[tuple[int, dict, str]], done: set, tokenizer: Any, max_model_len: int
) -> tuple[list[WorkItem], list[dict]]:
    """Render the prompts of every problem with samples still missing; reject those too long for the context."""
    renderer = _Renderer(cfg, tokenizer)
    items, rejects = [], []
    for number, row, row_id in selected:
        missing = [j for j in range(cfg.sampling.n) if (row_id, j) not in done]
        if not missing:
            continue
        hint = None if cfg.hint_field is None else row[cfg.hint_field]
        t_user, th_user = renderer.user_messages(row[cfg.prompt_field], hint, row)
        item = WorkItem(
            row_id,
            t_user,
            th_user,
            renderer.prompt(t_user, cfg.system_prompt_teacher),
            renderer.prompt(th_user, cfg.system_prompt_theta),
            missing,
        )
        longest = max(
            len(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in (item.teacher_prompt, item.theta_prompt)
        )
        if longest + 1 > max_model_len:
            reason = f"prompt has {longest} tokens; max_model_len is {max_model_len}"
            rejects.append({"id": row_id, "row": number, "reason": reason})
            continue
        items.append(item)
    return items, rejects


def sample_items(sampler: Any, cfg: RunConfig, items: list[WorkItem], models: dict) -> list[Outcome]:
    """Draw the missing samples of ``items`` (seeds from (seed, id, sample_index)); one outcome per sample."""
    out = sampler.generate(
        [i.theta_prompt for i in items],
        teacher_prompts=[i.teacher_prompt for i in items],
        prompt_keys=[i.id for i in items],
        sampling=cfg.sampling,
        use_tqdm=False,
    )
    outcomes = []
    for item, request in zip(items, out.requests):
        for j in item.missing:
            sample = request.samples[j]
            stats = {
                "tokens": len(sample.token_ids),
                "alpha_sum": math.fsum(sample.alpha),
                "alpha_sq": math.fsum(a * a for a in sample.alpha),
                "log_w_theta": sample.log_w_theta,
            }
            # Only complete, verified samples are training data; a failed one is logged and drawn again on --resume.
            if sample.ok:
                outcomes.append(Outcome(item.id, j, _record(cfg, item, j, sample, models), None, stats))
            else:
                outcomes.append(Outcome(item.id, j, None, _failure(item, j, sample), stats))
    return outcomes


def _paths(cfg: RunConfig) -> dict[str, Path]:
    out = Path(cfg.output)
    if out.suffix not in (".jsonl", ".parquet"):  # a directory of Parquet parts
        return {
            "output": out,
            "parts": out,
            "manifest": out / "manifest.json",
            "rejects": out / "rejects.jsonl",
            "failed": out / "failed.jsonl",
            "summary": out / "summary.json",
        }
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
    existing = [paths[k] for k in ("output", "journal", "manifest") if k in paths and paths[k].exists()]
    if not cfg.resume and existing and not (paths.get("parts") and not any(paths["parts"].iterdir())):
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


def _record(cfg: RunConfig, item: WorkItem, j: int, sample, models: dict) -> dict[str, Any]:
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


def _failure(item: WorkItem, j: int, sample) -> dict[str, Any]:
    """What a failed sample leaves behind: enough to see why, nothing to train on."""
    return {
        "id": item.id,
        "sample_index": j,
        "seed": sample.seed,
        "finish_reason": sample.finish_reason,
        "error": sample.error,
        "num_tokens": len(sample.token_ids),
    }


# ---------------------------------------------------------------------- where records go


class _JournalSink:
    """Records as whole JSONL lines, fsync'd per batch; a .parquet output is written from the journal at the end."""

    def __init__(self, paths: dict[str, Path], resume: bool) -> None:
        self.path, self.output = paths["journal"], paths["output"]
        self.done = {(r["id"], r["sample_index"]) for r in read_journal(self.path)} if resume else set()
        self.file = self.path.open("a", encoding="utf-8")

    def write(self, records: list[dict[str, Any]]) -> int:
        """Append the records not written yet (a retried batch may repeat some); return how many were new."""
        fresh = _fresh(records, self.done)
        if fresh:
            self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in fresh))
            self.file.flush()
            os.fsync(self.file.fileno())
        return len(fresh)

    def finish(self) -> None:
        self.close()
        if self.output.suffix == ".parquet":
            _write_parquet(self.path, self.output)

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


class _PartsSink:
    """Records as Parquet part files in a directory, for runs of any size.

    Each batch becomes one part, written under a temporary name, fsync'd, then renamed into
    place; a part left half-written by a crash keeps its temporary name and is never read.
    """

    def __init__(self, paths: dict[str, Path], resume: bool) -> None:
        import pyarrow.parquet as pq

        self.folder = paths["parts"]
        self.folder.mkdir(parents=True, exist_ok=True)
        for tmp in self.folder.glob("part-*.tmp"):
            tmp.unlink()
        parts = sorted(self.folder.glob("part-*.parquet"))
        self.done = set()
        if resume:
            for part in parts:
                table = pq.read_table(part, columns=["id", "sample_index"])
                self.done |= set(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))
        self.next = 1 + max((int(p.stem.split("-")[1]) for p in parts), default=-1)

    def write(self, records: list[dict[str, Any]]) -> int:
        import pyarrow as pa
        import pyarrow.parquet as pq

        fresh = _fresh(records, self.done)
        if fresh:
            final = self.folder / f"part-{self.next:06d}.parquet"
            tmp = final.with_name(final.name + ".tmp")
            pq.write_table(pa.Table.from_pylist(fresh), tmp)
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            dir_fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself survives a crash
            finally:
                os.close(dir_fd)
            self.next += 1
        return len(fresh)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def _fresh(records: list[dict[str, Any]], done: set) -> list[dict[str, Any]]:
    """The records whose (id, sample_index) is not written yet; marks them written."""
    fresh = []
    for r in records:
        key = (r["id"], r["sample_index"])
        if key not in done:
            done.add(key)
            fresh.append(r)
    return fresh


def _open_sink(paths: dict[str, Path], resume: bool) -> _JournalSink | _PartsSink:
    return _PartsSink(paths, resume) if "parts" in paths else _JournalSink(paths, resume)


def read_records(output: str) -> list[dict[str, Any]]:
    """Every record of a run's output: a .jsonl or .parquet file, or a directory of parts."""
    path = Path(output)
    if path.suffix == ".jsonl":
        return read_journal(path, repair=False)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    import pyarrow.parquet as pq

    return [r for part in sorted(path.glob("part-*.parquet")) for r in pq.read_table(part).to_pylist()]


class _Tally:
    """The run summary's numbers, kept as running sums (one float per sample for the ESS)."""

    def __init__(self) -> None:
        self.written = self.tokens = self.alpha_n = 0
        self.alpha_sum = self.alpha_sq = 0.0
        self.log_w: list[float] = []
        self.failures: collections.Counter = collections.Counter()

    def add(self, outcome: Outcome, new: bool = True) -> None:
        if outcome.failure is not None:
            self.failures[
                (outcome.failure.get("error") or outcome.failure.get("finish_reason") or "unknown").split(" at ")[0]
            ] += 1
            return
        if not new:
            return  # a retried batch repeated a sample already counted
        s = outcome.stats
        self.written += 1
        self.tokens += int(s["tokens"])
        self.alpha_n += int(s["tokens"])
        self.alpha_sum += s["alpha_sum"]
        self.alpha_sq += s["alpha_sq"]
        self.log_w.append(s["log_w_theta"])

    @property
    def alpha_mean(self) -> float | None:
        return self.alpha_sum / self.alpha_n if self.alpha_n else None

    def summary(self, cfg: RunConfig, already: int, rejects: list[dict], sync: dict, wall: float) -> dict[str, Any]:
        """Counts, α statistics, the ESS of the θ-weights, failures by error code, sync statistics, wall time."""
        mean = self.alpha_mean
        ess = effective_sample_size(self.log_w) if self.log_w else None
        return {
            "output": cfg.output,
            "samples_written": self.written,
            "samples_already_done": already,
            "failed_samples": sum(self.failures.values()),
            "failures": dict(sorted(self.failures.items())),
            "rejected_prompts": len(rejects),
            "generated_tokens": self.tokens,
            "alpha_mean": mean,
            "alpha_std": math.sqrt(max(self.alpha_sq / self.alpha_n - mean * mean, 0.0)) if self.alpha_n else None,
            "ess_theta_weights": ess,
            "ess_fraction": ess / len(self.log_w) if ess else None,
            "sync": sync,
            "wall_seconds": wall,
        }


# ---------------------------------------------------------------------- the run


def run_generation(cfg: RunConfig, sampler=None) -> dict[str, Any]:
    """Run (or resume) a data-generation run; return its summary (also written to the summary file).

    ``sampler`` is an open :class:`OptimalSamplingDual` on the same models to reuse; by default
    one is started and closed here. With ``cfg.ray`` the samples are drawn by Ray Data
    replicas (``dual_sampling.ray``) and this process only plans, writes and counts.
    """
    from transformers import AutoTokenizer

    from dual_sampling.engine import context_length

    started = time.monotonic()
    paths = _paths(cfg)
    rows = load_rows(cfg.input)
    selected, rejects = select_rows(cfg, rows)
    models = {"teacher": model_fingerprint(cfg.teacher), "theta": model_fingerprint(cfg.theta)}
    _check_manifest(cfg, paths, models)
    if sampler is not None:
        for role, wanted, running in (
            ("teacher", cfg.teacher, sampler.config.model_teacher),
            ("theta", cfg.theta, sampler.config.model_theta),
        ):
            if Path(wanted).resolve() != Path(running).resolve():
                raise ValueError(f"the sampler runs {role} {running!r} but the run configures {wanted!r}")
    sink = _open_sink(paths, cfg.resume)
    failed_log = tally = None
    try:
        already = len(sink.done)
        tokenizer = sampler.tokenizer if sampler is not None else AutoTokenizer.from_pretrained(cfg.teacher)
        max_model_len = context_length(cfg.teacher, cfg.theta, cfg.engine.max_model_len)
        items, too_long = plan_items(cfg, selected, sink.done, tokenizer, max_model_len)
        rejects += too_long
        _write_rejects(paths["rejects"], rejects)
        failed_log, tally = _Journal(paths["failed"]), _Tally()
        if cfg.ray:
            from dual_sampling.ray import sample_on_ray

            sync = sample_on_ray(cfg, items, models, lambda outcomes: _commit(outcomes, sink, failed_log, tally))
        else:
            sync = _sample_here(
                cfg, items, models, sampler, lambda outcomes: _commit(outcomes, sink, failed_log, tally)
            )
        sink.finish()
        failed_log.close()
        if not paths["failed"].stat().st_size:
            paths["failed"].unlink()
        summary = tally.summary(cfg, already, rejects, sync, time.monotonic() - started)
        paths["summary"].write_text(json.dumps(summary, indent=1) + "\n")
        return summary
    finally:
        sink.close()
        if failed_log is not None:
            failed_log.close()


def _commit(outcomes: list[Outcome], sink: Any, failed_log: _Journal, tally: _Tally) -> None:
    """Write a batch of outcomes: records once each (fsync'd), failures to the log, numbers to the tally."""
    records = [o.record for o in outcomes if o.record is not None]
    fresh_keys = {(r["id"], r["sample_index"]) for r in records} - set(sink.done)
    sink.write(records)
    failed_log.write(o.failure for o in outcomes if o.failure is not None)
    for o in outcomes:
        tally.add(o, new=(o.id, o.sample_index) in fresh_keys)


def _sample_here(cfg: RunConfig, items: list[WorkItem], models: dict, sampler: Any, commit) -> dict:
    """Draw every sample on this machine, ``batch_size`` problems per generate() call; return the sync statistics."""
    from tqdm.auto import tqdm

    from dual_sampling.engine import OptimalSamplingDual

    own = sampler is None
    if own:
        sampler = OptimalSamplingDual(cfg.teacher, cfg.theta, **{**dataclasses.asdict(cfg.engine), "use_tqdm": False})
    try:
        bar = tqdm(
            total=sum(len(i.missing) for i in items), desc="samples", unit="sample", disable=not cfg.engine.use_tqdm
        )
        generating, tokens, failed = time.monotonic(), 0, 0
        for start in range(0, len(items), cfg.batch_size):
            outcomes = sample_items(sampler, cfg, items[start : start + cfg.batch_size], models)
            commit(outcomes)
            tokens += sum(int(o.stats["tokens"]) for o in outcomes)
            failed += sum(o.failure is not None for o in outcomes)
            bar.set_postfix(tok_s=f"{tokens / max(time.monotonic() - generating, 1e-9):.1f}", failed=failed)
            bar.update(len(outcomes))
        bar.close()
        return sampler.get_sync_statistics()
    finally:
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
