"""Data-generation runs on a Ray cluster, with Ray Data: one dual engine per actor.

From Python, as a stage of your own pipeline::

    import ray
    from dual_sampling.datagen.ray_stage import DualSamplingStage, stage_kwargs

    ds = ray.data.read_parquet("problems.parquet")
    out = ds.map_batches(DualSamplingStage, fn_constructor_kwargs=stage_kwargs({"hint_field": "solution", "n": 4}),
                         concurrency=8, batch_size=64, num_cpus=2)      # on GPUs: num_gpus=2
    out.write_parquet("runs/math/")

``stage_kwargs`` runs in the driver: it provisions the default models (if the settings name none) and hashes both
once, so that no replica builds, dequantises or hashes a model.

From the command line, with the crash safety of a single-machine run::

    dual-sampling generate --input problems.parquet --output runs/math/ --hint-field solution --n 4 \\
        --ray --replicas 8 [--gpus-per-replica 2]

One replica is one :class:`OptimalSamplingDual` (a teacher and a theta engine on one node;
the shared memory stays on that node). Ray Data schedules the batches, retries a batch whose
actor died (the actor is restarted), and applies backpressure. On the command line this
process plans the work (the same prompt rendering, seeds and rejects as a local run, put
into the object store a batch at a time) and fingerprints the models once for every replica,
receives every replica's outcomes in a stream, and writes each (id, sample_index) exactly
once through the same journal or Parquet parts as a local run: a batch that Ray retries can
only repeat samples already written, which are skipped. A batch whose replica died more
than ``ray_max_retries`` times is not drawn again: its samples fail as ``replica_crashed``.
See ``docs/scale-out.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from typing import Any

# Ray is imported inside the functions that use it: it is optional and heavy, and run.py imports this module.
from dual_sampling import start_engine_server_early
from dual_sampling.datagen.draw import Outcome, sample_items
from dual_sampling.datagen.inputs import batched, model_fingerprints, select_rows
from dual_sampling.datagen.plan import WorkItem, plan_items
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.schema import records_table

__all__ = ["DualSamplingStage", "check_cluster_address", "ray_resources", "sample_on_ray", "stage_kwargs"]

_REPLICA_EXIT_S = 60.0
"""How long the driver of a cluster it started waits for its replicas and their engines to exit after stopping it."""
_OBJECT_STORE_BYTES = 256 << 20
"""Object store of a cluster a run starts itself: records are small, and this machine's memory goes to the models."""


def _run_config(settings: dict[str, Any]) -> RunConfig:
    """A run configuration from a stage's settings (input and output are the pipeline's business).

    Both model folders must be named: a RunConfig without them would provision the default models, which a
    replica never does (:func:`stage_kwargs` resolves them in the driver)."""
    missing = [name for name in ("teacher", "theta") if settings.get(name) is None]
    if missing:
        raise ValueError(
            f"a DualSamplingStage's settings must name {' and '.join(missing)}: replicas never provision models; "
            "build the stage's arguments with stage_kwargs(settings), which resolves the default models once"
        )
    return RunConfig.from_settings({"input": "-", "output": "-", **settings})


def stage_kwargs(settings: dict[str, Any] | None = None, emit: str = "records") -> dict[str, Any]:
    """The ``fn_constructor_kwargs`` of a :class:`DualSamplingStage`, made in the driver: the model folders resolved
    (the default ones provisioned if the settings name none) and fingerprinted here, once for every replica."""
    cfg = RunConfig.from_settings({"input": "-", "output": "-", **(settings or {})})
    resolved = {**(settings or {}), "teacher": cfg.source.teacher, "theta": cfg.source.theta}
    return {"settings": resolved, "emit": emit, "models": model_fingerprints(cfg)}


class DualSamplingStage:
    """A Ray Data ``map_batches`` stage: draws the samples of a batch of problems with one dual engine.

    ``settings`` are the flat keys of a data-generation run (``teacher``, ``theta``,
    ``prompt_field``, ``hint_field``, ``id_field``, ``n``, ``max_tokens``, ``alpha_method``,
    ...). A batch holds either raw problem rows (the fields the settings name) or work items
    planned by ``dual-sampling generate --ray``.

    ``emit="records"`` (the default) gives one row per complete, verified sample, in the
    Parquet schema of a local run (:func:`dual_sampling.datagen.schema.record_schema`: ``models``,
    ``sampling`` and ``alpha_config`` as JSON text); failed samples are left out.
    ``emit="outcomes"`` gives one row per drawn sample, failed ones included, with the
    replica's sync statistics (what the command line writes and counts).

    ``models`` are the fingerprints every record holds (:func:`stage_kwargs` and the command line compute them once,
    in the driver); without them each replica hashes the model folders itself.

    ``attempts`` (given by the command line) is a :class:`_Attempts` actor: with it a batch
    drawn more than ``ray_max_retries`` times before (each time its replica died) is not
    drawn again, and its samples fail as ``replica_crashed``. Without it Ray retries the
    batch as long as it is told to (by default without limit).
    """

    def __init__(
        self, settings: dict[str, Any] | None = None, emit: str = "records", attempts: Any = None, models: Any = None
    ) -> None:
        if emit not in ("records", "outcomes"):
            raise ValueError(f"emit must be 'records' or 'outcomes', got {emit!r}")
        self.cfg = _run_config(settings or {})
        start_engine_server_early()  # its imports of vLLM run beside this replica's own, below
        from dual_sampling.api import OptimalSamplingDual

        self.emit = emit
        self.attempts = attempts
        self.replica = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.models = models if models is not None else model_fingerprints(self.cfg)
        self.sampler = OptimalSamplingDual(
            self.cfg.source.teacher, self.cfg.source.theta, engine=self.cfg.engine, use_tqdm=False
        )

    def __call__(self, batch: dict[str, Any]) -> Any:
        import pyarrow as pa

        items = self._items(batch)
        outcomes = self._draw(items) if items else []
        if self.emit == "records":
            return records_table([o.record for o in outcomes if o.record is not None], self.cfg.format, self.cfg.roster)
        sync = json.dumps(self.sampler.get_sync_statistics(), allow_nan=False)
        return pa.table(
            {
                "id": [o.id for o in outcomes],
                "sample_index": [o.sample_index for o in outcomes],
                "outcome": [json.dumps(dataclasses.asdict(o), allow_nan=False) for o in outcomes],
                "replica": [self.replica] * len(outcomes),
                "sync": [sync] * len(outcomes),
            }
        )

    def _draw(self, items: list[WorkItem]) -> list[Outcome]:
        """The batch's outcomes; failures without drawing if its replica died on every one of its allowed attempts."""
        if self.attempts is not None:
            import ray

            key = hashlib.sha256(json.dumps([[i.id, i.missing] for i in items]).encode()).hexdigest()
            attempt = ray.get(self.attempts.start.remote(key))
            allowed = self.cfg.ray_max_retries + 1
            if attempt > allowed:
                return _crashed(self.cfg, items, allowed)
        return sample_items(self.sampler, self.cfg, items, self.models)

    def _items(self, batch: dict[str, Any]) -> list[WorkItem]:
        rows = _rows(batch)
        if rows and {f.name for f in dataclasses.fields(WorkItem)} <= set(rows[0]):  # planned by the command line
            return [WorkItem(**{f.name: _plain(r[f.name]) for f in dataclasses.fields(WorkItem)}) for r in rows]
        selected, _ = select_rows(self.cfg, rows)
        items, _ = plan_items(self.cfg, selected, set(), self.sampler.tokenizer, self.sampler.max_model_len)
        return items

    def __del__(self) -> None:
        sampler = getattr(self, "sampler", None)
        if sampler is not None:
            sampler.close()


def _rows(batch: Any) -> list[dict[str, Any]]:
    """A batch (dict of columns, pandas or pyarrow) as a list of plain row dicts."""
    if hasattr(batch, "to_pylist"):
        return batch.to_pylist()
    if hasattr(batch, "to_dict"):
        return batch.to_dict(orient="records")
    names = list(batch)
    return [{n: _plain(batch[n][i]) for n in names} for i in range(len(batch[names[0]]))] if names else []


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _crashed(cfg: RunConfig, items: list[WorkItem], attempts: int) -> list[Outcome]:
    """Failed outcomes for every missing sample of a batch whose replica died on each of its ``attempts``."""
    from dual_sampling.options import derive_seed

    error = f"replica_crashed at each of {attempts} attempts (ray_max_retries={cfg.ray_max_retries})"
    failure = {"finish_reason": "error", "error": error, "num_tokens": 0}
    return [
        Outcome(
            i.id,
            j,
            None,
            {"id": i.id, "sample_index": j, "seed": derive_seed(cfg.sampling.seed, i.id, j), **failure},
            None,
            {"tokens": 0},
        )
        for i in items
        for j in i.missing
    ]


class _Attempts:
    """How often each batch was started, kept by one actor beside the driver (a replica's own memory dies with it)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def start(self, key: str) -> int:
        """Count one more start of the batch ``key``; return its number (1 for the first)."""
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]

    def retried(self) -> int:
        """How many batches were started more than once (their replica died while it held them)."""
        return sum(count > 1 for count in self.counts.values())


def ray_resources(cpus_per_replica: float, gpus_per_replica: float) -> dict[str, Any]:
    """The ``map_batches`` resource arguments of one replica."""
    return {"num_cpus": cpus_per_replica, **({"num_gpus": gpus_per_replica} if gpus_per_replica else {})}


def sample_on_ray(
    cfg: RunConfig, items: Iterable[WorkItem], models: dict, commit: Callable[[list[Outcome]], None]
) -> dict:
    """Draw ``items`` on Ray Data replicas, committing each output batch as it arrives; return the replicas' summed
    sync statistics, with ``replicas`` (how many reported) and ``batches_retried`` (started more than once).

    The plan goes into the object store a batch at a time as it streams in (Ray spills it to disk past the store's
    size), so this process never holds it whole; the replicas get ``models``, the fingerprints made here.

    Uses the cluster RAY_ADDRESS names, or starts a local one (this machine's CPUs, a small
    object store, no dashboard) and stops it afterwards.
    """
    import ray

    from dual_sampling.lockstep import cleanup_stale_sessions

    started_here = False
    if not ray.is_initialized():
        address = check_cluster_address()
        try:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(
                    num_cpus=os.cpu_count(),
                    include_dashboard=False,
                    object_store_memory=_OBJECT_STORE_BYTES,
                    log_to_driver=False,
                )
                started_here = True
        except Exception as exc:
            raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address!r}: {exc}") from None
    latest: dict[str, dict] = {}
    retried = 0
    try:
        import pyarrow as pa

        # One block per batch: Ray Data hands an actor whole blocks, so a larger block would go to one replica whole
        # and come back only when all of it is drawn.
        blocks = [
            ray.put(pa.Table.from_pylist([dataclasses.asdict(item) for item in chunk]))
            for chunk in batched(items, cfg.batch_size)
        ]
        if blocks:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            attempts = ray.remote(_Attempts).options(num_cpus=0, scheduling_strategy=here).remote()
            dataset = ray.data.from_arrow_refs(blocks)
            out = dataset.map_batches(
                DualSamplingStage,
                fn_constructor_kwargs=_driver_stage_kwargs(cfg, models, attempts),
                concurrency=cfg.replicas,
                batch_size=cfg.batch_size,
                batch_format="pyarrow",
                # Ray Data's actor pools restart a dead replica and retry its batch without limit by default
                # (max_restarts=-1, max_task_retries=-1); the fault test relies on it. The stage ends a batch that
                # keeps killing its replica after ray_max_retries (with the attempts actor).
                **ray_resources(cfg.cpus_per_replica, cfg.gpus_per_replica),
            )
            for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
                rows = batch.to_pylist()
                commit([Outcome(**json.loads(r["outcome"])) for r in rows])
                for r in rows:
                    latest[r["replica"]] = json.loads(r["sync"])
            retried = ray.get(attempts.retried.remote())
            # Ray Data lets its replicas go once the dataset is dropped; each then closes its engines. Stopping the
            # cluster first would kill a replica's fork server mid-close, and vLLM would take its engines for dead.
            del out, dataset
            if started_here:
                _wait_for_exit(_local_replicas(), _REPLICA_EXIT_S)
    finally:
        if started_here:
            # Stopping the cluster kills replicas that are still closing their engines; once they and their
            # engines are gone, their session files and listed segments can be removed.
            replicas = _local_replicas()
            ray.shutdown()
            _wait_for_exit(replicas, _REPLICA_EXIT_S)
        cleanup_stale_sessions()
    return {**_sum_statistics(latest.values()), "batches_retried": retried}


def _driver_stage_kwargs(cfg: RunConfig, models: dict, attempts: Any) -> dict[str, Any]:
    """What the command line's replicas are built with: the run's settings (its model folders resolved here) and the
    fingerprints made here, so that no replica provisions or hashes a model."""
    settings = {k: v for k, v in cfg.flat().items() if k not in ("input", "output", "resume", "ray")}
    return {"settings": settings, "emit": "outcomes", "attempts": attempts, "models": models}


def _local_replicas() -> list[Any]:
    """The replicas of a cluster started here (descendants owning a session), with their engine processes."""
    import psutil

    from dual_sampling.lockstep import session_owners

    owners = session_owners()
    replicas = [p for p in psutil.Process().children(recursive=True) if p.pid in owners]
    out = list(replicas)
    for replica in replicas:
        with contextlib.suppress(psutil.Error):
            out += replica.children(recursive=True)
    return out


def _wait_for_exit(processes: list[Any], timeout_s: float) -> None:
    import psutil

    psutil.wait_procs(processes, timeout=timeout_s)


def check_cluster_address(timeout_s: float = 10.0) -> str | None:
    """The cluster ``RAY_ADDRESS`` names (None: a run starts its own), refused by name when it is a ``host:port`` (or
    ``ray://host:port``) nobody listens on: ``ray.init`` would retry for minutes. Needs no Ray, so a run checks it
    before it loads anything."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return address  # "auto" and other forms are left to ray.init
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address!r}: {exc}") from None
    return address


def _sum_statistics(replicas: Any) -> dict[str, Any]:
    """Every replica's statistics added up, and how many replicas reported."""
    total: dict[str, Any] = {}
    count = 0
    for stats in replicas:
        count += 1
        for key, value in stats.items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    total["replicas"] = count
    return total
