"""Data runs that stream: inputs read in batches give the rows (and shards) of a whole read, a resume reads only the
keys, the final Parquet file is the journal written a row group at a time, and Ray replicas get the fingerprints and
never build a model. No engine runs here.
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dual_sampling.datagen.ray_stage as ray_stage
import dual_sampling.datagen.sinks as sinks
from dual_sampling import models as model_builders
from dual_sampling.api import derive_seed
from dual_sampling.datagen.inputs import iter_batches, iter_rows, iter_selected, load_rows, model_fingerprints
from dual_sampling.datagen.plan import plan_items
from dual_sampling.datagen.run import run_generation
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.schema import record_schema, records_table
from dual_sampling.datagen.sinks import journal_keys, read_journal, read_records
from dual_sampling.testing.scripted import ScriptedSampler
from tests.test_datagen import all_pairs, problems, tiny_config


def whole_read(path) -> list[dict]:
    """The rows as the run read them before it streamed: the whole file at once."""
    if path.is_dir():
        from datasets import load_from_disk

        return [dict(r) for r in load_from_disk(str(path))]
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_inputs_read_in_batches_give_the_rows_shards_and_selection_of_a_whole_read(tiny_same, tmp_path):
    from datasets import Dataset

    # Nested values too: every reader must give the same Python values.
    rows = [
        {"id": f"p{i}", "problem": f"What is {i} plus 1?", "solution": f"{i + 1}", "meta": {"tags": [f"t{i}"], "k": i}}
        for i in range(40)
    ]
    rows[7]["problem"] = "   "  # rejected, in whichever shard it falls
    lines = [json.dumps(r) for r in rows]
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join([*lines[:20], "", *lines[20:]]) + "\n")  # a blank line is no row
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet", row_group_size=6)
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"), max_shard_size="2KB")
    assert pq.ParquetFile(tmp_path / "p.parquet").metadata.num_row_groups == 7
    for path in (src, tmp_path / "p.parquet", tmp_path / "ds"):
        assert whole_read(path) == rows, path
        batches = list(iter_batches(str(path), size=4))
        assert len(batches) >= 10 and all(1 <= len(b) <= 4 for b in batches), path
        assert [r for b in batches for r in b] == rows == load_rows(str(path)), path
        for shard in ("0/1", "0/3", "1/3", "2/3"):
            cfg = tiny_config(tiny_same, tmp_path, input=str(path), shard=shard)
            old_rejects: list[dict] = []
            old = list(iter_selected(cfg, rows, old_rejects))  # over the whole list, as before
            for unique in (True, False):
                rejects: list[dict] = []
                streamed = list(iter_selected(cfg, iter_rows(str(path)), rejects, unique=unique))
                assert streamed == old and rejects == old_rejects, (path, shard)
                seeds = [derive_seed(7, row_id, 0) for _, _, row_id in streamed]
                assert seeds == [derive_seed(7, row_id, 0) for _, _, row_id in old]


def test_a_jsonl_input_is_read_a_batch_at_a_time(tmp_path):
    """The first rows come before a bad line far down the file is read (a whole read would fail first)."""
    src = problems(tmp_path / "p.jsonl", 10)
    with src.open("a") as f:
        f.write("{not json\n")
    batches = iter_batches(str(src), size=4)
    assert [r["id"] for r in next(batches)] == ["p0", "p1", "p2", "p3"]
    with pytest.raises(ValueError, match="p.jsonl:11 is not valid JSON"):
        list(batches)


def test_a_run_never_reads_a_parquet_input_or_output_whole(tiny_same, tmp_path, monkeypatch):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(whole_read(problems(tmp_path / "p.jsonl", 6))), src, row_group_size=2)

    def whole(*args, **kwargs):
        raise AssertionError("pq.read_table read a whole file")

    monkeypatch.setattr(pq, "read_table", whole)
    out = tmp_path / "out.parquet"
    summary = run_generation(
        tiny_config(tiny_same, tmp_path, input=str(src), output=str(out)), ScriptedSampler(tiny_same)
    )
    assert summary["samples_written"] == 12
    monkeypatch.undo()
    assert {(r["id"], r["sample_index"]) for r in read_records(str(out))} == all_pairs()


def test_journal_repair_reads_line_by_line_as_the_whole_read_did(tmp_path):
    """Each case: (file bytes, ids read, bytes kept) or the line named as damaged."""
    a, b = '{"id": "a", "sample_index": 0}', '{"id": "b", "sample_index": 1}'
    cases = [
        (f"{a}\n{b}\n", ["a", "b"], f"{a}\n{b}\n"),
        (f"{a}\n{b}", ["a"], f"{a}\n"),  # a whole record without its newline is torn too
        (f"{a}\n\n  \n{b}\n", ["a", "b"], f"{a}\n\n  \n{b}\n"),  # blank lines are no records
        (f'{a}\n{{"id": "c", "sa\n', ["a"], f"{a}\n"),  # the last line ended but is not JSON
        (f"{a}\n\x00\x00\x00\n", ["a"], f"{a}\n"),  # zeros a crash left behind
        (f"{a}\n\x00\x00\x00\x00\x00\n", ["a"], f"{a}\n"),  # (bytes json cannot even decode)
        (f"{a}\n   ", ["a"], f"{a}\n"),
        ("", [], ""),
        (f'{a}\n{{"id": \n{b}\n', 2, None),
        (f'{a}\n{{"id": \n\n', 2, None),  # only the very last line may be torn
        (f'{a}\n{{"id": \n{b}', 2, None),
    ]
    for number, (text, expected, kept) in enumerate(cases):
        path = tmp_path / f"j{number}.jsonl"
        path.write_bytes(text.encode())
        if isinstance(expected, int):
            with pytest.raises(ValueError, match=f"j{number}.jsonl:{expected} is not a complete JSON record"):
                journal_keys(path)
            assert path.read_bytes() == text.encode()
            continue
        if kept == text:
            assert [r["id"] for r in read_journal(path, repair=False)] == expected
        else:
            with pytest.raises(ValueError, match="ends in a torn record"):
                read_journal(path, repair=False)
        assert journal_keys(path) == {(r, i) for r, i in zip(expected, (0, 1))}, text
        assert path.read_text() == kept, text
        assert [r["id"] for r in read_journal(path)] == expected


def test_a_resume_reads_only_the_key_columns_and_writes_what_an_uninterrupted_run_does(
    tiny_same, tmp_path, monkeypatch
):
    whole = tmp_path / "whole"
    run_generation(tiny_config(tiny_same, tmp_path, output=str(whole), batch_size=2), ScriptedSampler(tiny_same))
    out = tmp_path / "parts"
    run_generation(tiny_config(tiny_same, tmp_path, output=str(out), batch_size=2), ScriptedSampler(tiny_same))
    sorted(out.glob("part-*.parquet"))[1].unlink()  # as if the run died before committing its second batch
    read = pq.read_table
    columns = []

    def spy(source, *args, **kwargs):
        columns.append(kwargs.get("columns"))
        return read(source, *args, **kwargs)

    monkeypatch.setattr(pq, "read_table", spy)
    again = ScriptedSampler(tiny_same)
    resumed = run_generation(tiny_config(tiny_same, tmp_path, output=str(out), batch_size=2, resume=True), again)
    monkeypatch.undo()
    assert columns == [["id", "sample_index"]] * 2  # one read per part left, of the keys alone
    assert resumed["samples_already_done"] == 8 and resumed["samples_written"] == 4
    assert sorted(again.drawn) == [("p2", 0), ("p2", 1), ("p3", 0), ("p3", 1)]
    key = lambda r: (r["id"], r["sample_index"])
    assert sorted(read_records(str(out)), key=key) == sorted(read_records(str(whole)), key=key)


def test_a_journal_resume_keeps_only_the_keys(tiny_same, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    run_generation(tiny_config(tiny_same, tmp_path), ScriptedSampler(tiny_same))
    kept = out.read_text().splitlines()[:5]
    out.write_text("".join(line + "\n" for line in kept))
    seen = []
    keys = sinks.journal_keys

    def spy(path):
        got = keys(path)
        seen.append(set(got))  # the journal adds to it as it writes
        return got

    monkeypatch.setattr(sinks, "journal_keys", spy)
    monkeypatch.setattr(sinks, "read_journal", lambda *a, **k: pytest.fail("a resume read whole records"))
    summary = run_generation(tiny_config(tiny_same, tmp_path, resume=True), ScriptedSampler(tiny_same))
    monkeypatch.undo()
    assert seen[0] == {(json.loads(line)["id"], json.loads(line)["sample_index"]) for line in kept}
    assert summary["samples_already_done"] == 5 and summary["samples_written"] == 7


def test_the_final_parquet_is_its_journal_a_row_group_at_a_time(tiny_same, tmp_path, monkeypatch):
    monkeypatch.setattr(sinks, "ROWS_PER_GROUP", 5)
    for fmt in ("records", "messages"):
        out = tmp_path / f"{fmt}.parquet"
        parts = tmp_path / f"{fmt}-parts"
        for output in (out, parts):
            run_generation(
                tiny_config(tiny_same, tmp_path, output=str(output), format=fmt, keep_truncated=fmt == "messages"),
                ScriptedSampler(tiny_same),
            )
        journal = tmp_path / f"{fmt}.parquet.journal.jsonl"
        final = pq.read_table(out)
        assert pq.ParquetFile(out).metadata.num_row_groups == 3  # 12 records, 5 to a group
        assert final.schema.equals(record_schema(fmt), check_metadata=False)
        # What the whole-journal conversion wrote, and the concatenation of a parts run's parts: the same rows.
        assert final.equals(records_table(read_journal(journal), fmt))
        assert final.equals(pa.concat_tables(pq.read_table(p) for p in sorted(parts.glob("part-*.parquet"))))
    empty = tmp_path / "empty.parquet"
    sinks._write_parquet(tmp_path / "none.jsonl", empty, "records")
    assert pq.read_table(empty).equals(records_table([], "records"))


def test_replicas_get_the_fingerprints_and_never_build_or_hash_a_model(tiny_same, tmp_path, monkeypatch):
    """The command line's replica path without Ray: the driver makes the stage's arguments, a replica builds the stage
    from them and draws; every model builder and the hashing raise in the replica."""
    cfg = tiny_config(tiny_same, tmp_path)
    models = model_fingerprints(cfg)  # in the driver, once
    kwargs = ray_stage._driver_stage_kwargs(cfg, models, attempts=None)
    sampler = ScriptedSampler(tiny_same)
    items, _ = plan_items(
        cfg, [(i, r, r["id"]) for i, r in enumerate(load_rows(cfg.input))], set(), sampler.tokenizer, 256
    )
    batch = pa.Table.from_pylist([dataclasses.asdict(i) for i in items[:3]])
    local = tmp_path / "local.jsonl"
    run_generation(tiny_config(tiny_same, tmp_path, output=str(local)), ScriptedSampler(tiny_same))

    def forbidden(*args, **kwargs):
        raise AssertionError("a replica built or hashed a model")

    for name in ("smollm2", "smollm2_pruned", "provision", "gemma3_270m", "gemma3_270m_pruned"):
        monkeypatch.setattr(model_builders, name, forbidden)
    monkeypatch.setattr(ray_stage, "model_fingerprints", forbidden)
    monkeypatch.setattr("dual_sampling.datagen.inputs.model_fingerprint", forbidden)
    monkeypatch.setattr(
        "dual_sampling.api.OptimalSamplingDual", lambda teacher, theta, **_: ScriptedSampler((teacher, theta))
    )
    stage = ray_stage.DualSamplingStage(**kwargs)
    assert stage.models == models
    outcomes = [json.loads(r["outcome"]) for r in stage(batch).to_pylist()]
    assert [(o["id"], o["sample_index"]) for o in outcomes] == [(f"p{i}", j) for i in range(3) for j in range(2)]
    by_key = {(r["id"], r["sample_index"]): r for r in read_records(str(local))}
    for o in outcomes:
        assert o["record"] == by_key[(o["id"], o["sample_index"])]  # the models field too
    # Settings without the model folders would provision them: a replica refuses.
    settings = {k: v for k, v in kwargs["settings"].items() if k != "theta"}
    with pytest.raises(ValueError, match="must name theta: replicas never provision models"):
        ray_stage.DualSamplingStage(settings, models=models)


def test_stage_kwargs_resolve_and_fingerprint_the_models_in_the_driver(tiny_same):
    teacher, theta = tiny_same
    kwargs = ray_stage.stage_kwargs({"teacher": str(teacher), "theta": str(theta), "n": 2})
    cfg = RunConfig.from_settings({"input": "-", "output": "-", **kwargs["settings"]})
    assert kwargs["models"] == model_fingerprints(cfg) and kwargs["emit"] == "records"
    assert kwargs["settings"]["n"] == 2
