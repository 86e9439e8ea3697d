"""A vLLM-free simulation of two engines driving the real sync processors.

Each simulated engine runs in its own thread with its own persistent batch. It admits
requests in the driver's order (after random delays), removes finished ones, fills holes
by one-way moves, shuffles rows with random SWAPs, and calls the processor's
``update_state`` / ``apply`` exactly as vLLM's V1 runner does. Logits are a deterministic
function of (side, key, step), so a stale read shows up as a record that does not match.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from alpha import geometric_mix, get_alpha_computer
from dual_sampling.sampling import RowSampling
from dual_sampling.sync import (
    ERR_NONE, ERROR, ERROR_NAMES, NUM_RECORDS, TEACHER_FINISHED, THETA_FINISHED, SessionLayout, SyncSession,
)
from processors import TeacherSyncLogitsProcessor, ThetaSyncLogitsProcessor

VOCAB = 24
EOS = 0


NAN_STEP = 2
"""Step at which a request listed in ``nan_keys`` gets NaN logits on the theta side."""


def sim_logits(side: str, key: int, step: int, nan_keys: frozenset = frozenset()) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((side, key, step)) & 0x7FFFFFFF)
    row = torch.randn(VOCAB, generator=g) * (3.0 if side == "teacher" else 1.5)
    if side == "theta" and key in nan_keys and step == NAN_STEP:
        row[VOCAB // 2] = float("nan")
    return row


@dataclass
class SimRequest:
    key: int
    slot: int
    max_tokens: int
    stop_ids: tuple[int, ...]
    seed: int
    outputs: dict = field(default_factory=lambda: {"teacher": [], "theta": []})
    aborted: bool = False


class SimEngine(threading.Thread):
    def __init__(self, side: str, processor, max_seqs: int, rng: random.Random, finished: "queue.Queue",
                 nan_keys: frozenset = frozenset()):
        super().__init__(daemon=True, name=f"sim-{side}")
        self.nan_keys = nan_keys
        self.side, self.proc, self.max_seqs, self.rng, self.finished = side, processor, max_seqs, rng, finished
        self.inbox: "queue.Queue" = queue.Queue()
        self.aborts: "queue.Queue" = queue.Queue()
        self.batch: list[SimRequest | None] = []
        self.waiting: list[SimRequest] = []
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                self.step()
        except BaseException as exc:
            self.error = exc

    def step(self) -> None:
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        aborted = set()
        while True:
            try:
                aborted.add(self.aborts.get_nowait())
            except queue.Empty:
                break
        removed, added, moved = [], [], []
        for i, r in enumerate(self.batch):
            if r is not None and (self._done(r) or r.key in aborted):
                removed.append(i)
                self.batch[i] = None
        for r in self.waiting:
            if r.key in aborted:
                # Never admitted, so this side's processor never saw it: the driver releases for it.
                self.proc.session.control[r.slot, self.proc.released_word] = 1
        self.waiting = [r for r in self.waiting if r.key not in aborted]
        if self.rng.random() < 0.3:
            time.sleep(self.rng.random() * 0.003)  # arrival delays differ between the engines
        while self.waiting and sum(r is not None for r in self.batch) < self.max_seqs:
            r = self.waiting.pop(0)
            holes = [i for i, x in enumerate(self.batch) if x is None]
            index = holes[0] if holes else len(self.batch)
            if index == len(self.batch):
                self.batch.append(None)
            self.batch[index] = r
            params = SimpleNamespace(extra_args={"dual_sampling": {"slot": r.slot, "key": r.key, "sampling": RowSampling(
                seed=r.seed, stop_token_ids=r.stop_ids).to_dict()}})
            added.append((index, params, [1, 2, 3], r.outputs[self.side]))
        # Condense: move the last rows into holes, one way.
        while None in self.batch:
            hole = self.batch.index(None)
            last = max((i for i, x in enumerate(self.batch) if x is not None), default=-1)
            if last < hole:
                del self.batch[hole:]
                break
            self.batch[hole], self.batch[last] = self.batch[last], None
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        if len(self.batch) > 1 and self.rng.random() < 0.5:
            a, b = self.rng.sample(range(len(self.batch)), 2)
            self.batch[a], self.batch[b] = self.batch[b], self.batch[a]
            moved.append((a, b, MoveDirectionality.SWAP))
        if removed or added or moved:
            self.proc.update_state(BatchUpdate(len(self.batch), removed, added, moved))
        else:
            self.proc.update_state(None)
        if not self.batch:
            time.sleep(0.001)
            return
        logits = torch.stack([sim_logits(self.side, r.key, len(r.outputs[self.side]), self.nan_keys) for r in self.batch])
        logits = self.proc.apply(logits)
        for i, r in enumerate(self.batch):
            finite = torch.isfinite(logits[i])
            assert int(finite.sum()) == 1, "every row must allow exactly one token"
            r.outputs[self.side].append(int(logits[i].argmax()))
            if self._done(r):
                self.finished.put((self.side, r))

    @staticmethod
    def _done_ids(r: SimRequest, ids: list[int]) -> bool:
        return len(ids) >= r.max_tokens or (bool(ids) and ids[-1] in r.stop_ids)

    def _done(self, r: SimRequest) -> bool:
        return self._done_ids(r, r.outputs[self.side])


def run_simulation(seed: int, n_requests: int, max_seqs: int, abort_rate: float = 0.0, timeout_s: float = 60.0,
                   nan_keys: frozenset = frozenset()) -> dict:
    """Run one schedule; return a summary. Raises AssertionError on a stale read or a mismatch.

    Requests in ``nan_keys`` must fail with the slot error ``bad_logits`` (counted in "failed")."""
    rng = random.Random(seed)
    session = SyncSession.create(SessionLayout(VOCAB, 2 * max_seqs + 2, 64))
    try:
        cfg = {"session": session.name, "sync_timeout": 10.0, "abandon_token_id": EOS, "alpha_method": "kl_symmetry",
               "alpha_config": {}}
        procs = {
            "teacher": TeacherSyncLogitsProcessor(SimpleNamespace(additional_config={"dual_sampling": {**cfg, "role": "teacher"}}), torch.device("cpu"), False),
            "theta": ThetaSyncLogitsProcessor(SimpleNamespace(additional_config={"dual_sampling": {**cfg, "role": "theta"}}), torch.device("cpu"), False),
        }
        finished: "queue.Queue" = queue.Queue()
        engines = {side: SimEngine(side, procs[side], max_seqs, random.Random(rng.random()), finished, nan_keys)
                   for side in procs}
        for e in engines.values():
            e.start()
        todo = [SimRequest(key=k + 1, slot=-1, max_tokens=rng.randint(1, 20), stop_ids=(EOS, rng.randrange(1, VOCAB)),
                           seed=rng.randrange(1 << 30)) for k in range(n_requests)]
        todo.reverse()
        in_flight: dict[int, SimRequest] = {}
        sides_done: dict[int, set] = {}
        completed, aborted_keys, failed = 0, 0, {}
        deadline = time.monotonic() + timeout_s
        while todo or in_flight:
            assert time.monotonic() < deadline, f"deadlock: {len(in_flight)} requests in flight"
            for e in engines.values():
                assert e.error is None, f"{e.side} engine failed: {e.error!r}"
            free = [s for s in range(session.layout.slots) if session.slot_free(s) and s not in {r.slot for r in in_flight.values()}]
            while todo and free:
                r = todo.pop()
                r.slot = free.pop()
                session.open_slot(r.slot, r.key)
                in_flight[r.key] = r
                sides_done[r.key] = set()
                for e in engines.values():
                    e.inbox.put(r)
                if rng.random() < abort_rate:
                    r.aborted = True
                    for e in engines.values():
                        e.aborts.put(r.key)
                    session.mark_finished(r.slot, TEACHER_FINISHED)
                    session.mark_finished(r.slot, THETA_FINISHED)
            try:
                side, r = finished.get(timeout=0.05)
            except queue.Empty:
                # aborted requests never report; retire them once both processors released the slot
                for key, req in list(in_flight.items()):
                    if req.aborted:
                        session.close_slot(req.slot)
                        del in_flight[key]
                        aborted_keys += 1
                continue
            if r.key not in in_flight:
                continue
            session.mark_finished(r.slot, TEACHER_FINISHED if side == "teacher" else THETA_FINISHED)
            sides_done[r.key].add(side)
            if len(sides_done[r.key]) < 2:
                continue
            del in_flight[r.key]
            if r.aborted:
                session.close_slot(r.slot)
                aborted_keys += 1
                continue
            if r.key in nan_keys and r.max_tokens > NAN_STEP and not _stopped_before(r, NAN_STEP):
                failed[r.key] = ERROR_NAMES[int(session.control[r.slot, ERROR])]
                session.close_slot(r.slot)
                continue
            t_ids, th_ids = r.outputs["teacher"], r.outputs["theta"]
            assert t_ids == th_ids, f"request {r.key}: streams differ {t_ids} vs {th_ids}"
            assert int(session.control[r.slot, ERROR]) == ERR_NONE, f"request {r.key}: error {int(session.control[r.slot, ERROR])}"
            assert int(session.control[r.slot, NUM_RECORDS]) == len(t_ids)
            check_records(session, r, t_ids)
            session.close_slot(r.slot)
            completed += 1
        for e in engines.values():
            e.stop_flag.set()
            e.join(timeout=10)
        # One last update on each side retires the finished requests, so every slot is released.
        for side, e in engines.items():
            removed = [i for i, x in enumerate(e.batch) if x is not None]
            procs[side].update_state(BatchUpdate(0, removed, [], []))
        leaked = [s for s in range(session.layout.slots) if not session.slot_free(s)]
        return {"completed": completed, "aborted": aborted_keys, "failed": failed, "leaked_slots": leaked,
                "stats": session.statistics()}
    finally:
        session.close()


def _stopped_before(r: SimRequest, step: int) -> bool:
    """The request ended (on a stop id) before reaching ``step``."""
    ids = r.outputs["teacher"]
    return any(t in r.stop_ids for t in ids[:step])


def check_records(session: SyncSession, r: SimRequest, tokens: list[int]) -> None:
    """Recompute every step from the deterministic logits: a stale or mismatched row fails here."""
    ac = get_alpha_computer("kl_symmetry")
    for step, tok in enumerate(tokens):
        lt = torch.log_softmax(sim_logits("teacher", r.key, step), -1)
        lth = torch.log_softmax(sim_logits("theta", r.key, step), -1)
        a = ac(lth, lt)
        rec = session.records[r.slot, step]
        assert session.tokens[r.slot, step] == tok
        assert math.isclose(rec[0], float(a), abs_tol=1e-5), f"request {r.key} step {step}: alpha {rec[0]} != {float(a)}"
        assert math.isclose(rec[2], float(lth[tok]), abs_tol=1e-5), f"request {r.key} step {step}: stale theta row"
        assert math.isclose(rec[1], float(lt[tok]), abs_tol=1e-5)
        assert math.isclose(rec[3], float(geometric_mix(lth, lt, a)[tok]), abs_tol=1e-5)
