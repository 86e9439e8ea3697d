"""What goes into a run: the problem rows (read in batches from JSONL, Parquet or a datasets folder, checked and
split into shards) and content fingerprints of the input and of the model folders, which the manifest keeps.

Nothing here holds the whole input: a run reads it once to check every row (keeping only the ids, to find a
duplicate) and once more to plan and draw, batch by batch.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dual_sampling.datagen.run_config import RunConfig

__all__ = [
    "batched",
    "input_fingerprint",
    "iter_batches",
    "iter_rows",
    "iter_selected",
    "load_rows",
    "model_fingerprint",
    "model_fingerprints",
    "select_rows",
    "shard_of",
]

ROWS_PER_BATCH = 1024
"""Rows read at a time: a Parquet batch, JSONL lines, a datasets slice."""

T = TypeVar("T")


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lists of ``size`` consecutive items (the last may be shorter); itertools.batched from Python 3.12."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def shard_of(row_id: str, count: int) -> int:
    """The shard (0..count-1) a row id belongs to: stable across machines and row orders."""
    return int.from_bytes(hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "little") % count


def iter_batches(path: str, size: int = ROWS_PER_BATCH) -> Iterator[list[dict[str, Any]]]:
    """The rows of a .jsonl / .parquet file or a local datasets folder as dicts, ``size`` at a time, in file order."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input {path!r} does not exist")
    if p.is_dir():
        yield from _dataset_batches(p, size)
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(p) as f:
            for batch in f.iter_batches(batch_size=size):  # row group by row group
                yield batch.to_pylist()
    else:
        yield from batched(_jsonl_rows(p), size)


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number} is not valid JSON: {exc.msg}") from None


def _dataset_batches(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ImportError(
            "reading a datasets folder needs the 'datasets' package: pip install 'dual-sampling[data]'"
        ) from None
    data = load_from_disk(str(path))  # memory-mapped: nothing is read until a slice is
    if isinstance(data, DatasetDict):
        raise ValueError(
            f"{str(path)!r} is a DatasetDict with splits {list(data.keys())}; point --input at one split's folder"
        )
    for columns in data.iter(batch_size=size):
        names = list(columns)
        yield [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]


def iter_rows(path: str) -> Iterator[dict[str, Any]]:
    """The rows of an input one by one, read a batch at a time."""
    for batch in iter_batches(path):
        yield from batch


def load_rows(path: str) -> list[dict[str, Any]]:
    """Every row of a .jsonl / .parquet file or a local datasets folder, as dicts (for small inputs and tests)."""
    return list(iter_rows(path))


def iter_selected(
    cfg: RunConfig, rows: Iterable[dict], rejects: list[dict], unique: bool = True
) -> Iterator[tuple[int, dict, str]]:
    """(row number, row, id) of this shard's rows, in input order; rows rejected before generation go to ``rejects``.

    Every row must have the fields the run names; with ``unique`` the ids must differ (their first row numbers are
    kept to name a duplicate: the only thing held per row). A second pass over checked rows passes False."""
    seen: dict[str, int] = {}
    for number, row in enumerate(rows):
        for name in (cfg.source.prompt_field, *cfg.source.hint_fields.values(), cfg.id_field):
            if name is not None and name not in row:
                raise ValueError(f"row {number} has no field {name!r} (fields: {sorted(row)})")
        row_id = str(row[cfg.id_field]) if cfg.id_field else str(number)
        if unique:
            if row_id in seen:
                raise ValueError(f"rows {seen[row_id]} and {number} share the id {row_id!r}")
            seen[row_id] = number
        if shard_of(row_id, cfg.shard_count) != cfg.shard_index:
            continue
        problem = row[cfg.source.prompt_field]
        if not isinstance(problem, str) or not problem.strip():
            rejects.append({"id": row_id, "row": number, "reason": "empty prompt"})
            continue
        yield number, row, row_id


def select_rows(cfg: RunConfig, rows: Iterable[dict]) -> tuple[list[tuple[int, dict, str]], list[dict]]:
    """(row number, row, id) of this shard's rows, and the rows rejected before generation."""
    rejects: list[dict] = []
    selected = list(iter_selected(cfg, rows, rejects))
    return selected, rejects


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


def model_fingerprints(cfg: RunConfig) -> dict[str, dict[str, str]]:
    """Each model's fingerprint by roster name ("teacher" and "theta" for a pair): what every record's ``models``
    holds. Hashing reads every weight, so a run does it once, in its driver, and ships the result to its Ray
    replicas."""
    return {name: model_fingerprint(folder) for name, folder in cfg.source.folders.items()}


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
