"""Where a run's files go: the layout of an output (a JSONL or Parquet file, or a folder of Parquet parts, and the
files beside it), the lock that keeps a second run off it, the JSONL journal (torn tails repaired), the Parquet
parts, and :func:`read_records`, which reads any of them back as the same dicts.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dual_sampling.datagen.durable import dumps, replace_durably, write_text_durably
from dual_sampling.datagen.inputs import batched
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.schema import record_schema, records_table, table_records
from dual_sampling.roster import PAIR, Roster
from dual_sampling.run_output import open_no_follow, own_dir, single_writer

__all__ = [
    "KEY_COLUMNS",
    "Journal",
    "iter_journal",
    "journal_keys",
    "open_sink",
    "output_lock",
    "output_paths",
    "read_journal",
    "read_records",
    "write_rejects",
]


KEY_COLUMNS = ("id", "sample_index")
"""What identifies a record: a resume reads these columns of the parts and nothing else."""
ROWS_PER_GROUP = 1024
"""Records per row group of a Parquet file written from its journal: what is held in memory at a time."""


def output_paths(cfg: RunConfig) -> dict[str, Path]:
    """Every file of a run by its role: the output (with its journal or parts), manifest, logs, summary and lock."""
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


def output_lock(cfg: RunConfig, paths: dict[str, Path]) -> contextlib.AbstractContextManager[None]:
    """Hold the output's lock for the whole run: two writers would write samples twice, and one's torn-tail repair
    could cut off the other's record. A second run fails at once instead of waiting."""
    return single_writer(cfg.output, paths["lock"])


def iter_journal(path: Path, repair: bool = True) -> Iterator[dict[str, Any]]:
    """Records of a JSONL journal, read line by line. A torn last line (no newline, or not JSON) is cut off when
    ``repair`` (once every record is read); a bad line anywhere else is corruption and raises ValueError naming it."""
    if not path.exists():
        return
    bad: tuple[int, int] | None = None  # (line number, offset) of a line that is not JSON: only the last may be
    cut = None
    offset = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if bad is not None:
                raise ValueError(f"{path}:{bad[0]} is not a complete JSON record; the file is damaged")
            if not line.endswith(b"\n"):  # bytes after the last newline: a record the kill tore
                cut = start
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line[:-1])
            except ValueError:  # not JSON, or not even text (zeros a crash left)
                bad = (number, start)
                continue
            yield record
    if bad is not None:
        cut = bad[1]
    if cut is not None:
        if not repair:
            raise ValueError(f"{path} ends in a torn record")
        with open_no_follow(path, "ab") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())


def read_journal(path: Path, repair: bool = True) -> list[dict[str, Any]]:
    """Every record of a JSONL journal (see :func:`iter_journal`)."""
    return list(iter_journal(path, repair))


def journal_keys(path: Path) -> set[tuple[str, int]]:
    """The (id, sample_index) pairs of a journal, its torn tail cut off: what a resume needs of it, and all it keeps."""
    return {(r["id"], r["sample_index"]) for r in iter_journal(path)}


class Journal:
    """Append-only JSONL of lines keyed by (id, sample_index), one fsync per batch.

    Resuming reads it first (cutting a torn last line, which an append would otherwise glue
    to the next record) and remembers the pairs it holds; a new run starts it empty.
    """

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.done = journal_keys(path) if resume else set()
        self.file = open_no_follow(path, "a" if resume else "w")

    def write(self, records: Iterable[dict[str, Any]], unique: bool = True) -> list[dict[str, Any]]:
        """Append ``records`` (if ``unique``, only pairs not written yet: a retried batch may repeat some); return
        those appended."""
        fresh = _fresh(records, self.done) if unique else list(records)
        if fresh:
            self.file.write("".join(dumps(r) + "\n" for r in fresh))
            self.file.flush()
            os.fsync(self.file.fileno())
        return fresh

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


class _JournalSink:
    """Records as whole JSONL lines, fsync'd per batch; a .parquet output is written from the journal at the end."""

    def __init__(self, paths: dict[str, Path], resume: bool, fmt: str, roster: Roster) -> None:
        self.journal, self.output, self.format = Journal(paths["journal"], resume), paths["output"], fmt
        self.roster = roster
        self.done = self.journal.done

    def write(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append the records not written yet (a retried batch may repeat some); return them."""
        return self.journal.write(records)

    def finish(self) -> None:
        self.close()
        if self.output.suffix == ".parquet":
            _write_parquet(self.journal.path, self.output, self.format, self.roster)

    def close(self) -> None:
        self.journal.close()


class _PartsSink:
    """Records as Parquet part files in a directory, for runs of any size.

    Each batch becomes one part, written under a temporary name, fsync'd, then renamed into
    place; a part left half-written by a crash keeps its temporary name and is never read.
    """

    def __init__(self, paths: dict[str, Path], resume: bool, fmt: str, roster: Roster) -> None:
        import pyarrow.parquet as pq

        self.format, self.roster = fmt, roster
        self.folder = own_dir(paths["parts"])
        for tmp in self.folder.glob("part-*.tmp"):
            tmp.unlink()
        parts = sorted(self.folder.glob("part-*.parquet"))
        self.done = set()
        if resume:
            for part in parts:
                table = pq.read_table(part, columns=list(KEY_COLUMNS))  # the keys alone, not the records
                self.done.update(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))
        self.next = 1 + max((int(p.stem.split("-")[1]) for p in parts), default=-1)

    def write(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write the records not written yet as one part; return them."""
        import pyarrow.parquet as pq

        fresh = _fresh(records, self.done)
        if fresh:
            final = self.folder / f"part-{self.next:06d}.parquet"
            tmp = final.with_name(final.name + ".tmp")
            with open_no_follow(tmp, "wb") as f:
                pq.write_table(records_table(fresh, self.format, self.roster), f)
            replace_durably(tmp, final)
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


def open_sink(paths: dict[str, Path], resume: bool, fmt: str, roster: Roster = PAIR) -> _JournalSink | _PartsSink:
    """Where a run's records of format ``fmt`` go, in the schema of ``roster`` (:func:`record_fields`)."""
    sink = _PartsSink if "parts" in paths else _JournalSink
    return sink(paths, resume, fmt, roster)


def read_records(output: str) -> list[dict[str, Any]]:
    """Every record of a run's output (a .jsonl or .parquet file, or a directory of parts), as the same dicts."""
    import pyarrow.parquet as pq

    path = Path(output)
    if path.suffix == ".jsonl":
        return read_journal(path, repair=False)
    parts = [path] if path.suffix == ".parquet" else sorted(path.glob("part-*.parquet"))
    return [r for part in parts for r in table_records(pq.read_table(part))]


def write_rejects(path: Path, rejects: list[dict]) -> None:
    """Rejects follow from the dataset and configuration alone, so each invocation rewrites them whole."""
    if not rejects:
        path.unlink(missing_ok=True)
        return
    write_text_durably(path, "".join(dumps(r) + "\n" for r in rejects))


def _write_parquet(journal: Path, output: Path, fmt: str, roster: Roster = PAIR) -> None:
    """The Parquet file of a journal's records, written a row group at a time (never the whole journal at once)."""
    import pyarrow.parquet as pq

    tmp = output.with_name(output.name + ".tmp")
    with open_no_follow(tmp, "wb") as f, pq.ParquetWriter(f, record_schema(fmt, roster)) as writer:
        for chunk in batched(iter_journal(journal), ROWS_PER_GROUP):
            writer.write_table(records_table(chunk, fmt, roster))
    replace_durably(tmp, output)
