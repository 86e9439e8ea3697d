"""Prometheus metrics for ``/metrics``: the counters the server updates as requests and samples end
(:class:`Metrics`) and the gauges read from the engines at scrape time."""

from __future__ import annotations

from typing import Any

from dual_sampling.records import SampleRecord

__all__ = ["Metrics"]


class Metrics:
    """Prometheus metrics: requests, tokens, running and queued samples, α, sync waits and timeouts, engine deaths."""

    # service: the DualService reported on, typed loosely because serving imports this module (not the reverse).
    def __init__(self, service: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.service = service
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dual_sampling_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.finished = Counter(
            "dual_sampling_samples_finished", "Samples by finish reason", ["finish_reason"], registry=self.registry
        )
        self.tokens = Counter("dual_sampling_generated_tokens", "Tokens of finished samples", registry=self.registry)
        self.disconnects = Counter(
            "dual_sampling_client_disconnects", "Requests whose client went away", registry=self.registry
        )
        self.alpha = Histogram(
            "dual_sampling_alpha",
            "Teacher weight α per generated token (with several teachers, their total Σα)",
            buckets=[i / 10 for i in range(1, 11)],
            registry=self.registry,
        )
        self.server_errors = Counter(
            "dual_sampling_server_errors",
            "Faults of the server itself (500s and failed streams)",
            registry=self.registry,
        )
        self.send_timeouts = Counter(
            "dual_sampling_send_timeouts",
            "Requests aborted because their client stopped reading for send_timeout",
            registry=self.registry,
        )
        self.rejected = 0
        self.registry.register(_EngineCollector(service))

    def observe(self, sample: SampleRecord) -> None:
        self.finished.labels(sample.finish_reason or "unknown").inc()
        self.tokens.inc(len(sample.token_ids))
        for a in sample.total_alpha:  # with several teachers, their total weight
            self.alpha.observe(a)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engines at scrape time."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        dual = self.service.dual
        stats = dual.get_sync_statistics()
        yield GaugeMetricFamily("dual_sampling_requests_running", "Samples in the engines", value=stats["in_flight"])
        yield GaugeMetricFamily(
            "dual_sampling_requests_queued", "Samples waiting for the engines", value=stats["queued"]
        )
        yield GaugeMetricFamily(
            "dual_sampling_samples_held", "Samples the server holds (running or queued)", value=self.service.held
        )
        waits = CounterMetricFamily(
            "dual_sampling_sync_wait_seconds", "Time an engine waited for its partner", labels=["side"]
        )
        for side, key in (
            ("teacher", "teacher_wait_s"),
            ("theta", "theta_wait_s"),
            ("theta_plan", "follower_plan_wait_s"),
        ):
            waits.add_metric([side], stats.get(key, 0.0))
        yield waits
        yield CounterMetricFamily(
            "dual_sampling_sync_timeouts",
            "Rows failed after sync_timeout",
            value=stats.get("teacher_timeouts", 0) + stats.get("theta_timeouts", 0),
        )
        yield CounterMetricFamily(
            "dual_sampling_engine_deaths",
            "Engine processes that exited",
            value=int(dual.failure is not None and "engine failed" in str(dual.failure)),
        )
        yield CounterMetricFamily(
            "dual_sampling_rejected_requests", "Requests refused with 429", value=self.service.metrics.rejected
        )
        updates = CounterMetricFamily("dual_sampling_weight_updates", "Weight updates per engine", labels=["role"])
        versions = GaugeMetricFamily(
            "dual_sampling_weight_version_info",
            "Each engine's weight version now (the label is the version)",
            labels=["role", "version"],
        )
        for role, version in dual.weight_versions.items():
            updates.add_metric([role], stats.get(f"{role}_updates", 0))
            versions.add_metric([role, version], 1.0)
        yield updates
        yield versions
