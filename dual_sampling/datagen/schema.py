"""The record schema of a run. A record is a :class:`Record` (``--format records``) or a :class:`MessagesRecord`
(``--format messages``); their fields are the one declaration of both the JSONL lines and the Parquet schema
(:func:`record_fields`, :func:`record_schema`).

:class:`Record` declares a pair's record. A run of several teachers has the same fields with the roster's
columns in place of the pair's (:func:`record_fields`): a prompt per model (``<name>_prompt``), α per teacher
(``alpha_<teacher>``), log π per model (``logp_<name>``), and their sums and log weights likewise.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, TypedDict

from dual_sampling.datagen.durable import dumps
from dual_sampling.roster import PAIR, Roster

__all__ = ["Message", "MessagesRecord", "Record", "record_fields", "record_schema", "records_table", "table_records"]


@dataclass
class Record:
    """One training record of ``--format records``: one complete, verified sample with finite numbers.

    These fields are the record's one declaration: a JSONL line holds exactly them, and the
    Parquet schema is derived from their types (:func:`record_schema`). ``models``,
    ``sampling`` and ``alpha_config`` are JSON objects in JSONL and the same objects as JSON
    text in Parquet (their shape varies with the configuration, so no fixed column type
    holds them); :func:`~dual_sampling.datagen.sinks.read_records` gives the same dicts from either.
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
    teacher_version: str
    """The teacher's weight version that drew the sample ("0": the weights its engine started with). With several
    teachers, the first teacher's (teachers of such a run keep the weights they start with)."""
    theta_version: str
    """Theta's weight version that drew the sample: the policy whose π_θ ``log_w_theta`` refers to."""
    score: float | None
    """The user score of the sample (``--score``), None without one."""
    score_name: str | None
    """The function that gave ``score`` ("module:function")."""
    models: dict[str, Any]
    """Path and content hash of each model folder, by roster name ("teacher" and "theta" for a pair)."""
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
"""Arrow field metadata of a column holding JSON text; :func:`table_records` decodes it."""


def _record_class(fmt: str) -> type:
    return MessagesRecord if fmt == "messages" else Record


def record_fields(fmt: str = "records", roster: Roster = PAIR) -> dict[str, Any]:
    """Each field of a record in format ``fmt`` of a run of ``roster``, with its type, in order: the record class's
    fields, each group of columns the pair names (its prompts, token columns, their sums, its log weights) in
    place of the first of them, as ``roster`` names it. ValueError naming ``teacher`` where a teacher's name makes a
    column the record has already (a teacher named "config" would write its α over ``alpha_config``)."""
    cls = _record_class(fmt)
    hints = typing.get_type_hints(cls)
    groups = {
        PAIR.prompt_columns: roster.prompt_columns,
        PAIR.token_columns: roster.token_columns,
        PAIR.sum_columns: roster.sum_columns,
        PAIR.weight_columns: roster.weight_columns,
    }
    names: list[tuple[str, Any]] = []
    for f in dataclasses.fields(cls):
        group = next((g for g in groups if f.name in g), None)
        if group is None:
            names.append((f.name, hints[f.name]))
        elif f.name == group[0]:
            names += [(name, hints[f.name]) for name in groups[group]]
    out = dict(names)
    if len(out) < len(names):
        twice = sorted({n for n, _ in names if sum(m == n for m, _ in names) > 1})
        raise ValueError(f"teacher: the teachers' names make record columns the record has already: {twice}")
    return out


def record_schema(fmt: str = "records", roster: Roster = PAIR):
    """The Parquet (Arrow) schema of a run's records in format ``fmt``, derived from :func:`record_fields`."""
    import pyarrow as pa

    fields = []
    for name, hint in record_fields(fmt, roster).items():
        hint = _not_none(hint)
        if typing.get_origin(hint) is dict:
            fields.append(pa.field(name, pa.string(), metadata=_JSON_TEXT))
        else:
            fields.append(pa.field(name, _arrow_type(hint)))
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


def records_table(records: list[dict[str, Any]], fmt: str, roster: Roster = PAIR):
    """``records`` (as written to JSONL) as an Arrow table of :func:`record_schema`; a value of another type raises."""
    import pyarrow as pa

    schema = record_schema(fmt, roster)
    text = [f.name for f in schema if f.metadata == _JSON_TEXT]
    rows = [{**r, **{k: None if r[k] is None else dumps(r[k]) for k in text}} for r in records]
    return pa.Table.from_pylist(rows, schema=schema)


def table_records(table) -> list[dict[str, Any]]:
    """The rows of a records table, with its JSON-text columns decoded (the inverse of :func:`records_table`)."""
    text = [f.name for f in table.schema if f.metadata == _JSON_TEXT]
    rows = table.to_pylist()
    for r in rows:
        for k in text:
            if r[k] is not None:
                r[k] = json.loads(r[k])
    return rows
