"""Reading a request's records out of its slot: the deltas while it streams, and the verified sample at its end.

Independent token streams meet at the end: what the leader's processor decided (the slot's
tokens), and what each engine emitted. A sample is data only if they all agree, every token
has its record, and every record is finite; otherwise it fails with a named
:class:`ErrorCode` and carries no records.
"""

from __future__ import annotations

import itertools

import numpy as np

from dual_sampling.driver.requests import DualRequest, Flight, request_columns
from dual_sampling.lockstep import RECORD_FIELDS, ErrorCode, Finish, Phase, Slot, SyncSession
from dual_sampling.records import SampleDelta, SampleRecord, own_and_other
from dual_sampling.roster import PAIR, THETA, Roster
from dual_sampling.text import sample_text

__all__ = ["collect_sample", "delta_of"]


def dense_copies(session: SyncSession, slot: int, start: int, end: int, k: int) -> tuple[np.ndarray, ...] | None:
    """Copies of a slot's dense top-k records for tokens [start, end), or None when k is 0: for a pair, (ids, own
    and other log-probabilities), each ``[n, 2, k]``; for more models, (ids ``[n, M, k]``, log-probabilities
    ``[n, M, M, k]``, ``[:, i, j]`` model j's at model i's ids)."""
    if not k:
        return None
    ids, logp = session.dense_ids[slot, start:end, :, :k].copy(), session.dense_logp[slot, start:end, ..., :k]
    return (ids, *own_and_other(logp)) if session.layout.models == 2 else (ids, logp.copy())


def delta_of(session: SyncSession, flight: Flight, start: int, sample: SampleRecord | None = None) -> SampleDelta:
    """The delta of the flight's tokens from ``start`` on, with the records written for them so far."""
    slot, sampling = flight.slot, flight.request.sampling
    # Records stop where the leader's processor stopped writing them: a failed row's forced token has none, and the
    # slot's rows past it still hold an earlier request's values.
    end = min(len(flight.tokens), max(start, int(session.control[slot, Slot.NUM_RECORDS])))
    k = sampling.top_logprobs
    roster = Roster(session.names)
    running = flight.request.models(roster)  # a model left out has no log π at q's top tokens
    models = [p for p, name in enumerate(roster.names) if name in running]
    top = (
        tuple(
            a[slot, start:end, :k].copy()
            for a in (session.top_ids, session.top_logq, *(session.top_logp[:, :, p] for p in models))
        )
        if k
        else None
    )
    records, columns = session.records[slot, start:end].copy(), None
    if len(running) < len(roster.names):  # a request that left teachers out: their log π was never computed
        columns = request_columns(roster, flight.request.teachers)
        records = records[:, [roster.token_columns.index(c) for c in columns]]
    return SampleDelta(
        flight.tokens[start:],
        records,
        sample,
        top,
        dense_copies(session, slot, start, end, sampling.dense_logprobs),
        columns,
    )


def theta_versions(flight: Flight, n: int) -> tuple[str, list[str] | None]:
    """θ's version of a sample of ``n`` tokens (its first token's; the latest when it has none), and each token's
    where they span θ updates taken while ``pause(mode="keep")`` held it (None where one version drew them all)."""
    per_token = [flight.versions[THETA]] * n
    latest = flight.versions[THETA]
    for start, latest in flight.theta_changes:  # in order: each from its token on
        per_token[start:] = [latest] * max(n - start, 0)
    if not per_token:
        return latest, None
    return per_token[0], (per_token if len(set(per_token)) > 1 else None)


def collect_sample(
    session: SyncSession,
    flight: Flight,
    roster: Roster,
    follower_tokens: dict[str, list[int]],
    leader_finish: str | None,
    tokenizer: object,
) -> tuple[SampleRecord, ErrorCode]:
    """The verified sample of a request every engine has ended, and its error code (NONE when it is data);
    ``follower_tokens``: what each following engine emitted, by model name."""
    slot, tokens = flight.slot, flight.tokens
    control = session.control[slot]
    code, step = session.error(slot)
    finish = Finish(int(control[Slot.FINISH])) if int(control[Slot.PHASE]) == Phase.FINISHED else Finish.NONE
    stop_index = int(control[Slot.STOP_INDEX])
    recorded = session.tokens[slot, : len(tokens)].tolist()
    records = session.records[slot, : len(tokens)].copy()
    emitted = {roster.names[0]: tokens, **follower_tokens}  # each engine's stream, by model name
    first_teacher = next(name for name in roster.teachers if name in emitted)  # the first the request ran
    sample = SampleRecord(
        text="",
        token_ids=recorded,
        finish_reason=finish.reason or leader_finish,
        seed=flight.request.sampling.seed,
        teacher_token_ids=list(emitted[first_teacher]),
        theta_token_ids=list(emitted[THETA]),
        teacher_version=flight.versions[first_teacher],
        teachers=flight.request.teachers,
    )
    sample.theta_version, sample.theta_versions = theta_versions(flight, len(recorded))
    streams = (tokens, *follower_tokens.values(), recorded)
    if code == ErrorCode.NONE and (
        any(stream != tokens for stream in streams) or int(control[Slot.NUM_RECORDS]) < len(tokens)
    ):
        code, step = ErrorCode.DIVERGED, _first_difference(*streams)
    non_finite = np.flatnonzero(~np.isfinite(records).all(axis=1))
    if code == ErrorCode.NONE and non_finite.size:  # the engine checks each row; this is the last line
        code, step = ErrorCode.NON_FINITE, int(non_finite[0])
    if code != ErrorCode.NONE:
        sample.finish_reason = "error"
        sample.error = f"{code.label} at step {step}"
    else:
        _set_records(sample, roster, records, flight.request)
        dense = dense_copies(session, slot, 0, len(tokens), flight.request.sampling.dense_logprobs)
        if dense is not None:
            sample.dense_ids, sample.dense_logp, *other = dense
            sample.dense_other_logp = other[0] if other else None
    stop = (
        flight.request.stop[stop_index]
        if finish == Finish.STOP_STRING and 0 <= stop_index < len(flight.request.stop)
        else None
    )
    sample.stop_reason = stop if stop is not None else (tokens[-1] if finish == Finish.STOP and tokens else None)
    sample.text = sample_text(tokenizer, tokens, stop, stop_token=finish == Finish.STOP)
    return sample, code


def _set_records(sample: SampleRecord, roster: Roster, records: np.ndarray, request: DualRequest) -> None:
    """A verified sample's per-token records, ``[n, columns]`` in ``roster``'s token columns: a pair's in its fields;
    with several teachers every column in :attr:`SampleRecord.roster_columns`, and θ's and q's in their fields too."""
    if roster == PAIR:
        for name, column in zip(RECORD_FIELDS, records.T):
            setattr(sample, name, column.tolist())
        return
    # A teacher the request left out weighs 0 (its α column says so); its log π was never computed: no column.
    kept = request_columns(roster, request.teachers)
    sample.roster_columns = {
        name: column.tolist() for name, column in zip(roster.token_columns, records.T) if name in kept
    }
    sample.logp_theta = list(sample.roster_columns[f"logp_{THETA}"])
    sample.logq = list(sample.roster_columns["logq"])


def _first_difference(*streams: list[int]) -> int:
    """The first position where the token streams disagree (or where the shorter one ends)."""
    for i, values in enumerate(itertools.zip_longest(*streams)):
        if len(set(values)) > 1:
            return i
    return 0
