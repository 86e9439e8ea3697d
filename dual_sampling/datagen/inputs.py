"""What goes into a run: the problem rows (read from JSONL, Parquet or a datasets folder, checked and split into
shards) and content fingerprints of the input and of the model folders, which the manifest keeps.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dual_sampling.datagen.run_config import RunConfig

__all__ = ["input_fingerprint", "load_rows", "model_fingerprint", "select_rows", "shard_of"]


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
