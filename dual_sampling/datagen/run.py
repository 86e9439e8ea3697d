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

Only complete, verified samples with finite numbers are training data: a sample that
failed (or was aborted, or has a non-finite α, log π or log q) goes to ``OUT.failed.jsonl``
with its error, never to the output, and is drawn again by ``--resume``. The summary counts
failures by their error code. No JSON this module writes holds NaN or infinity.

A record is a :class:`Record` (``--format records``) or a :class:`MessagesRecord`
(``--format messages``); their fields are the one declaration of both the JSONL lines and
the Parquet schema (:func:`record_schema`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import time
import types
import typing
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from dual_sampling.options import EngineOptions, SamplingOptions
from dual_sampling.records import effective_sample_size

__all__ = [
    "DEFAULT_TEACHER_TEMPLATE",
    "DEFAULT_THETA_TEMPLATE",
    "MessagesRecord",
    "Record",
    "RunConfig",
    "input_fingerprint",
    "load_rows",
    "model_fingerprint",
    "read_journal",
    "read_records",
    "record_schema",
    "records_table",
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
    "ray_max_retries",
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
    keep_truncated: bool = False
    """With format "messages": keep answers cut off at max_tokens (finish_reason "length") as training targets,
    marked ``truncated``; by default they are left out, logged to OUT.truncated.jsonl and counted in the summary."""
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
    ray_max_retries: int = 3
    """With --ray: how often a batch whose replica died is drawn again (on the restarted replica); after that its
    samples fail as replica_crashed (drawn again by --resume), so a batch that always kills its replica ends."""
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
        if self.keep_truncated and self.format != "messages":
            raise ValueError("keep_truncated applies to format 'messages' only; records keep every answer")
        if Path(self.output).suffix not in (".jsonl", ".parquet", ""):
            raise ValueError(f"output must be a .jsonl or .parquet file, or a directory, got {self.output!r}")
        self.shard_index, self.shard_count = _parse_shard(self.shard)
        for name, least in (("batch_size", 1), ("replicas", 1), ("ray_max_retries", 0)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
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


def input_fingerprint(path: str) -> dict[str, str]:
    """SHA-256 of the input's bytes, streamed: {file name: hex digest}; a folder's files by their relative paths.

    Contents, not size and modification time: an edit that keeps both must still be seen.
    """
    root = Path(path)
    files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
    out = {}
    for f in files:
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        out[f.relative_to(root).as_posix() if root.is_dir() else f.name] = h.hexdigest()
    return out


# ---------------------------------------------------------------------- journal


def _dumps(value: Any) -> str:
    """JSON as every file of a run holds it: NaN and infinity are refused (they are not JSON)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` survive a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(tmp: Path, path: Path) -> None:
    """Rename a finished ``tmp`` over ``path``: its bytes reach the disk first, then the rename does."""
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_text_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    _replace_durably(tmp, path)


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
    """Append-only JSONL of lines keyed by (id, sample_index), one fsync per batch.

    Resuming reads it first (cutting a torn last line, which an append would otherwise glue
    to the next record) and remembers the pairs it holds; a new run starts it empty.
    """

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.done = {(r["id"], r["sample_index"]) for r in read_journal(path)} if resume else set()
        self.file = path.open("a" if resume else "w", encoding="utf-8")

    def write(self, records: Iterable[dict[str, Any]], unique: bool = True) -> list[dict[str, Any]]:
        """Append ``records`` (if ``unique``, only pairs not written yet: a retried batch may repeat some); return
        those appended."""
        fresh = _fresh(records, self.done) if unique else list(records)
        if fresh:
            self.file.write("".join(_dumps(r) + "\n" for r in fresh))
            self.file.flush()
            os.fsync(self.file.fileno())
        return fresh

    def close(self) -> None:
        if not self.file.closed:
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


# ---------------------------------------------------------------------- records


@dataclass
class Record:
    """One training record of ``--format records``: one complete, verified sample with finite numbers.

    These fields are the record's one declaration: a JSONL line holds exactly them, and the
    Parquet schema is derived from their types (:func:`record_schema`). ``models``,
    ``sampling`` and ``alpha_config`` are JSON objects in JSONL and the same objects as JSON
    text in Parquet (their shape varies with the configuration, so no fixed column type
    holds them); :func:`read_records` gives the same dicts from either.
    """

    id: str
    sample_index: int
    seed: int
    """The sample's seed, derived from (run seed, id, sample_index)."""
    teacher_prompt: str
    theta_prompt: str
    response: str
    token_ids: list[int]
    finish_reason: str
    """"stop" (a stop string, EOS or a stop token) or "length" (cut off at max_tokens)."""
    stop_reason: str | None
    """The stop string that ended the sample; None if none did (then see ``stop_token_id``)."""
    stop_token_id: int | None
    """The token id (EOS or one of stop_token_ids) that ended the sample; None if none did."""
    error: str | None
    """Always None: a failed sample is never a record (it goes to OUT.failed.jsonl)."""
    num_tokens: int
    alpha: list[float]
    """Teacher weight α at each generated token."""
    logp_teacher: list[float]
    logp_theta: list[float]
    logq: list[float]
    """log-probability of each token under the distribution actually sampled from."""
    sum_alpha: float
    sum_logp_teacher: float
    sum_logp_theta: float
    sum_logq: float
    log_w_theta: float
    """Σ (log π_θ − log q): the sequence's log importance weight towards theta."""
    log_w_teacher: float
    """Σ (log π_t − log q): likewise towards the teacher."""
    models: dict[str, Any]
    """Path and content hash of the teacher and theta model folders."""
    sampling: dict[str, Any]
    """Every sampling option; logit_bias as [token id, bias] pairs (JSON object keys could not stay ints)."""
    alpha_config: dict[str, Any]
    """The α method, its bounds and its options."""


class Message(TypedDict):
    """One chat message of a :class:`MessagesRecord`."""

    role: str
    content: str


@dataclass
class MessagesRecord:
    """One training record of ``--format messages`` (TRL's SFT trainer reads ``messages``), declared as Record is."""

    id: str
    sample_index: int
    messages: list[Message]
    """Theta's system message (if any), its user message, and the sampled answer."""
    truncated: bool
    """True: the answer was cut off at max_tokens (only written with ``keep_truncated``)."""


_JSON_TEXT = {b"dual_sampling.encoding": b"json"}
"""Arrow field metadata of a column holding JSON text; :func:`read_records` decodes it."""


def _record_class(fmt: str) -> type:
    return MessagesRecord if fmt == "messages" else Record


def record_schema(fmt: str = "records"):
    """The Parquet (Arrow) schema of a run's records in format ``fmt``, derived from its record class's fields."""
    import pyarrow as pa

    cls = _record_class(fmt)
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = _not_none(hints[f.name])
        if typing.get_origin(hint) is dict:
            fields.append(pa.field(f.name, pa.string(), metadata=_JSON_TEXT))
        else:
            fields.append(pa.field(f.name, _arrow_type(hint)))
    return pa.schema(fields)


def _not_none(hint: Any) -> Any:
    """X for ``X | None`` (every column may hold nulls), else ``hint``."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        (inner,) = (a for a in typing.get_args(hint) if a is not type(None))
        return inner
    return hint


def _arrow_type(hint: Any):
    import pyarrow as pa

    if typing.get_origin(hint) is list:
        return pa.list_(_arrow_type(typing.get_args(hint)[0]))
    if typing.is_typeddict(hint):
        return pa.struct([pa.field(k, _arrow_type(v)) for k, v in typing.get_type_hints(hint).items()])
    scalars = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
    if hint not in scalars:
        raise TypeError(f"no Parquet column type for a record field of type {hint!r}")
    return scalars[hint]


def records_table(records: list[dict[str, Any]], fmt: str):
    """``records`` (as written to JSONL) as an Arrow table of :func:`record_schema`; a value of another type raises."""
    import pyarrow as pa

    schema = record_schema(fmt)
    text = [f.name for f in schema if f.metadata == _JSON_TEXT]
    rows = [{**r, **{k: None if r[k] is None else _dumps(r[k]) for k in text}} for r in records]
    return pa.Table.from_pylist(rows, schema=schema)


def _table_records(table) -> list[dict[str, Any]]:
    """The rows of a records table, with its JSON-text columns decoded (the inverse of :func:`records_table`)."""
    text = [f.name for f in table.schema if f.metadata == _JSON_TEXT]
    rows = table.to_pylist()
    for r in rows:
        for k in text:
            if r[k] is not None:
                r[k] = json.loads(r[k])
    return rows


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
    """What one drawn sample leaves: a record (training data), a failure, or a left-out answer; and its numbers."""

    id: str
    sample_index: int
    record: dict[str, Any] | None
    """A :class:`Record` or :class:`MessagesRecord` as a dict."""
    failure: dict[str, Any] | None
    left_out: dict[str, Any] | None
    """A complete answer that is not training data (cut off at max_tokens, format "messages", not keep_truncated):
    logged, so that --resume does not draw it again."""
    stats: dict[str, float]
    """What the run summary needs, whatever the format: tokens; for a record also alpha_sum, alpha_sq,
    log_w_theta and truncated (1.0 if cut off at max_tokens)."""


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
            tokens = {"tokens": len(sample.token_ids)}
            # Only complete, verified samples with finite numbers are training data; a failed one is logged and
            # drawn again on --resume.
            error = _non_finite(sample) if sample.ok else sample.error
            if not sample.ok or error is not None:
                outcomes.append(Outcome(item.id, j, None, _failure(item, j, sample, error), None, tokens))
            elif cfg.format == "messages" and sample.finish_reason == "length" and not cfg.keep_truncated:
                outcomes.append(Outcome(item.id, j, None, None, _failure(item, j, sample, None), tokens))
            else:
                stats = {
                    **tokens,
                    "alpha_sum": math.fsum(sample.alpha),
                    "alpha_sq": math.fsum(a * a for a in sample.alpha),
                    "log_w_theta": sample.log_w_theta,
                    "truncated": float(sample.finish_reason == "length"),
                }
                outcomes.append(Outcome(item.id, j, _record(cfg, item, j, sample, models), None, None, stats))
    return outcomes


def _non_finite(sample: Any) -> str | None:
    """The error of a sample with a non-finite α, log π or log q (JSON cannot hold one, and it is no data); None."""
    for name in ("alpha", "logp_teacher", "logp_theta", "logq"):
        for position, value in enumerate(getattr(sample, name)):
            if not math.isfinite(value):
                return f"non_finite_record at token {position}: {name} is {value}"
    return None


def _paths(cfg: RunConfig) -> dict[str, Path]:
    out = Path(cfg.output)
    if out.suffix not in (".jsonl", ".parquet"):  # a directory of Parquet parts
        return {
            "output": out,
            "parts": out,
            "manifest": out / "manifest.json",
            "rejects": out / "rejects.jsonl",
            "failed": out / "failed.jsonl",
            "truncated": out / "truncated.jsonl",
            "summary": out / "summary.json",
            "lock": out.with_name(out.name + ".lock"),
        }
    journal = out if out.suffix == ".jsonl" else out.with_name(out.name + ".journal.jsonl")
    return {
        "output": out,
        "journal": journal,
        "manifest": out.with_name(out.name + ".manifest.json"),
        "rejects": out.with_name(out.stem + ".rejects.jsonl"),
        "failed": out.with_name(out.stem + ".failed.jsonl"),
        "truncated": out.with_name(out.stem + ".truncated.jsonl"),
        "summary": out.with_name(out.name + ".summary.json"),
        "lock": out.with_name(out.name + ".lock"),
    }


@contextmanager
def _output_lock(cfg: RunConfig, paths: dict[str, Path]) -> Iterator[None]:
    """Hold the output's lock for the whole run: two writers would write samples twice, and one's torn-tail repair
    could cut off the other's record. A second run fails at once instead of waiting."""
    from filelock import FileLock, Timeout

    path = paths["lock"]
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise FileExistsError(
            f"{cfg.output} is being written by another run: its lock file {path} is held; wait for that run to end"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _check_manifest(cfg: RunConfig, paths: dict[str, Path], models: dict, inputs: dict[str, str]) -> None:
    """Refuse to resume a run of another configuration or input, or one without a manifest; write a new run's."""
    identity = {**cfg.identity(), "models": models}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, allow_nan=False).encode()).hexdigest()
    manifest = paths["manifest"]
    existing = [paths[k] for k in ("output", "journal", "manifest") if k in paths and paths[k].exists()]
    if paths.get("parts") and not (paths["parts"].exists() and any(paths["parts"].iterdir())):
        existing = []  # an empty directory holds no run
    if cfg.resume and manifest.exists():
        old = json.loads(manifest.read_text())
        if old["config_hash"] != digest:
            now = json.loads(json.dumps(identity))
            changed = sorted(k for k in set(old["config"]) | set(now) if old["config"].get(k) != now.get(k))
            details = "; ".join(f"{k}: {old['config'].get(k)!r} -> {identity.get(k)!r}" for k in changed)
            raise ValueError(f"refusing to resume {cfg.output}: the configuration differs ({details})")
        _check_input(cfg, old["input_sha256"], inputs)
        return
    if cfg.resume and existing:
        # Without the manifest nothing shows which configuration and input wrote what is there.
        raise FileNotFoundError(
            f"refusing to resume {cfg.output}: its manifest {manifest} is missing, so its configuration and input "
            "cannot be checked; remove the output to start over"
        )
    if not cfg.resume and existing:
        raise FileExistsError(
            f"{cfg.output} (or its journal or manifest) already exists; pass --resume to continue it, "
            "or remove it to start over"
        )
    manifest.parent.mkdir(parents=True, exist_ok=True)
    created = time.strftime("%Y-%m-%dT%H:%M:%S")
    text = {"config_hash": digest, "config": identity, "input_sha256": inputs, "created": created}
    _write_text_durably(manifest, json.dumps(text, indent=1, allow_nan=False) + "\n")


def _check_input(cfg: RunConfig, old: dict[str, str], now: dict[str, str]) -> None:
    """Refuse to resume on an input whose contents differ from the run's, naming each file that changed."""
    if old == now:
        return
    folder = Path(cfg.input).is_dir()
    changes = []
    for name in sorted(set(old) | set(now)):
        shown = Path(cfg.input) / name if folder else cfg.input
        if name not in now:
            changes.append(f"{shown} is gone")
        elif name not in old:
            changes.append(f"{shown} is new")
        elif old[name] != now[name]:
            changes.append(f"{shown} changed (sha256 {old[name][:12]}… -> {now[name][:12]}…)")
    raise ValueError(f"refusing to resume {cfg.output}: its input changed since the run started: {'; '.join(changes)}")


def _record(cfg: RunConfig, item: WorkItem, j: int, sample, models: dict) -> dict[str, Any]:
    if cfg.format == "messages":
        messages = [Message(role="system", content=cfg.system_prompt_theta)] if cfg.system_prompt_theta else []
        messages += [Message(role="user", content=item.theta_user), Message(role="assistant", content=sample.text)]
        return dataclasses.asdict(MessagesRecord(item.id, j, messages, truncated=sample.finish_reason == "length"))
    engine = cfg.engine
    by_string = isinstance(sample.stop_reason, str)
    record = Record(
        id=item.id,
        sample_index=j,
        seed=sample.seed,
        teacher_prompt=item.teacher_prompt,
        theta_prompt=item.theta_prompt,
        response=sample.text,
        token_ids=sample.token_ids,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason if by_string else None,
        stop_token_id=None if by_string or sample.stop_reason is None else int(sample.stop_reason),
        error=sample.error,
        num_tokens=len(sample.token_ids),
        alpha=sample.alpha,
        logp_teacher=sample.logp_teacher,
        logp_theta=sample.logp_theta,
        logq=sample.logq,
        sum_alpha=math.fsum(sample.alpha),
        sum_logp_teacher=math.fsum(sample.logp_teacher),
        sum_logp_theta=math.fsum(sample.logp_theta),
        sum_logq=math.fsum(sample.logq),
        log_w_theta=sample.log_w_theta,
        log_w_teacher=sample.log_w_teacher,
        models=models,
        sampling={
            **dataclasses.asdict(cfg.sampling),
            "logit_bias": [[t, b] for t, b in cfg.sampling.logit_bias.items()],
        },
        alpha_config={
            "method": engine.alpha_method,
            "alpha_min": engine.alpha_min,
            "alpha_max": engine.alpha_max,
            **engine.alpha_config,
        },
    )
    return dataclasses.asdict(record)


def _failure(item: WorkItem, j: int, sample, error: str | None) -> dict[str, Any]:
    """What a failed (or left-out) sample leaves behind: enough to see why, nothing to train on."""
    return {
        "id": item.id,
        "sample_index": j,
        "seed": sample.seed,
        "finish_reason": sample.finish_reason,
        "error": error,
        "num_tokens": len(sample.token_ids),
    }


# ---------------------------------------------------------------------- where records go


class _JournalSink:
    """Records as whole JSONL lines, fsync'd per batch; a .parquet output is written from the journal at the end."""

    def __init__(self, paths: dict[str, Path], resume: bool, fmt: str) -> None:
        self.journal, self.output, self.format = _Journal(paths["journal"], resume), paths["output"], fmt
        self.done = self.journal.done

    def write(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append the records not written yet (a retried batch may repeat some); return them."""
        return self.journal.write(records)

    def finish(self) -> None:
        self.close()
        if self.output.suffix == ".parquet":
            _write_parquet(self.journal.path, self.output, self.format)

    def close(self) -> None:
        self.journal.close()


class _PartsSink:
    """Records as Parquet part files in a directory, for runs of any size.

    Each batch becomes one part, written under a temporary name, fsync'd, then renamed into
    place; a part left half-written by a crash keeps its temporary name and is never read.
    """

    def __init__(self, paths: dict[str, Path], resume: bool, fmt: str) -> None:
        import pyarrow.parquet as pq

        self.format = fmt
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

    def write(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write the records not written yet as one part; return them."""
        import pyarrow.parquet as pq

        fresh = _fresh(records, self.done)
        if fresh:
            final = self.folder / f"part-{self.next:06d}.parquet"
            tmp = final.with_name(final.name + ".tmp")
            pq.write_table(records_table(fresh, self.format), tmp)
            _replace_durably(tmp, final)
            self.next += 1
        return fresh

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


def _open_sink(paths: dict[str, Path], resume: bool, fmt: str) -> _JournalSink | _PartsSink:
    return _PartsSink(paths, resume, fmt) if "parts" in paths else _JournalSink(paths, resume, fmt)


def read_records(output: str) -> list[dict[str, Any]]:
    """Every record of a run's output (a .jsonl or .parquet file, or a directory of parts), as the same dicts."""
    import pyarrow.parquet as pq

    path = Path(output)
    if path.suffix == ".jsonl":
        return read_journal(path, repair=False)
    parts = [path] if path.suffix == ".parquet" else sorted(path.glob("part-*.parquet"))
    return [r for part in parts for r in _table_records(pq.read_table(part))]


class _Tally:
    """The run summary's numbers, kept as running sums (one float per sample for the ESS)."""

    def __init__(self) -> None:
        self.written = self.tokens = self.alpha_n = self.truncated = self.left_out = 0
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

    @property
    def alpha_mean(self) -> float | None:
        return self.alpha_sum / self.alpha_n if self.alpha_n else None

    def summary(self, cfg: RunConfig, already: int, rejects: list[dict], sync: dict, wall: float) -> dict[str, Any]:
        """Counts, α statistics, the ESS of the θ-weights, failures by error code, sync statistics, wall time.

        ``truncated_samples`` counts the answers cut off at max_tokens that were written, ``truncated_left_out`` those
        left out (format "messages" without keep_truncated)."""
        mean = self.alpha_mean
        ess = effective_sample_size(self.log_w) if self.log_w else None
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
    replicas (``dual_sampling.datagen.ray_stage``) and this process only plans, writes and counts.
    """
    started = time.monotonic()
    paths = _paths(cfg)
    with _output_lock(cfg, paths):
        return _run(cfg, sampler, paths, started)


def _run(cfg: RunConfig, sampler: Any, paths: dict[str, Path], started: float) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from dual_sampling.api import context_length

    rows = load_rows(cfg.input)
    inputs = input_fingerprint(cfg.input)
    selected, rejects = select_rows(cfg, rows)
    models = {"teacher": model_fingerprint(cfg.teacher), "theta": model_fingerprint(cfg.theta)}
    _check_manifest(cfg, paths, models, inputs)
    if sampler is not None:
        for role, wanted, running in (
            ("teacher", cfg.teacher, sampler.config.model_teacher),
            ("theta", cfg.theta, sampler.config.model_theta),
        ):
            if Path(wanted).resolve() != Path(running).resolve():
                raise ValueError(f"the sampler runs {role} {running!r} but the run configures {wanted!r}")
    sink = _open_sink(paths, cfg.resume, cfg.format)
    logs: list[_Journal] = []
    try:
        for name in ("failed", "truncated"):
            logs.append(_Journal(paths[name], cfg.resume))
        writer = _Writer(sink, *logs)
        already = len(sink.done) + len(writer.left_out.done)
        tokenizer = sampler.tokenizer if sampler is not None else AutoTokenizer.from_pretrained(cfg.teacher)
        max_model_len = context_length(cfg.teacher, cfg.theta, cfg.engine.max_model_len)
        items, too_long = plan_items(cfg, selected, sink.done | writer.left_out.done, tokenizer, max_model_len)
        rejects += too_long
        _write_rejects(paths["rejects"], rejects)
        if cfg.ray:
            from dual_sampling.datagen.ray_stage import sample_on_ray

            sync = sample_on_ray(cfg, items, models, writer.commit)
        else:
            sync = _sample_here(cfg, items, models, sampler, writer.commit)
        sink.finish()
        for log in logs:
            log.close()
            if not log.path.stat().st_size:
                log.path.unlink()
        summary = writer.tally.summary(cfg, already, rejects, sync, time.monotonic() - started)
        _write_text_durably(paths["summary"], json.dumps(summary, indent=1, allow_nan=False) + "\n")
        return summary
    finally:
        sink.close()
        for log in logs:
            log.close()


class _Writer:
    """Where a batch of outcomes goes: records to the sink (once each), failures and left-out answers to their logs,
    numbers to the tally."""

    def __init__(self, sink: Any, failed: _Journal, left_out: _Journal) -> None:
        self.sink, self.failed, self.left_out, self.tally = sink, failed, left_out, _Tally()

    def commit(self, outcomes: list[Outcome]) -> None:
        fresh = self.sink.write([o.record for o in outcomes if o.record is not None])
        fresh += self.left_out.write([o.left_out for o in outcomes if o.left_out is not None])
        self.failed.write([o.failure for o in outcomes if o.failure is not None], unique=False)
        fresh_keys = {(r["id"], r["sample_index"]) for r in fresh}
        for o in outcomes:
            self.tally.add(o, new=(o.id, o.sample_index) in fresh_keys)


def _sample_here(cfg: RunConfig, items: list[WorkItem], models: dict, sampler: Any, commit) -> dict:
    """Draw every sample on this machine, ``batch_size`` problems per generate() call; return the sync statistics."""
    from tqdm.auto import tqdm

    from dual_sampling.api import OptimalSamplingDual

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
    _write_text_durably(path, "".join(_dumps(r) + "\n" for r in rejects))


def _write_parquet(journal: Path, output: Path, fmt: str) -> None:
    import pyarrow.parquet as pq

    tmp = output.with_name(output.name + ".tmp")
    pq.write_table(records_table(read_journal(journal), fmt), tmp)
    _replace_durably(tmp, output)
