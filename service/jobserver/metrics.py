"""Prometheus metrics of one service instance (its own registry, so several can share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bnrecal.service.jobserver.records.views import JobStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _JobsByStatus(Collector):
    """``bnrecal_jobs{status=...}``, counted in the ledger at scrape time."""

    def __init__(self, count: Callable[[], dict[JobStatus, int]]) -> None:
        self._count = count

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("bnrecal_jobs", "Jobs in the ledger by status.", labels=["status"])
        for status, value in self._count().items():
            family.add_metric([status.value], value)
        yield family


class ServiceMetrics:
    """The counters the runner and the routes update, and the text ``/metrics`` serves."""

    def __init__(self, count_jobs: Callable[[], dict[JobStatus, int]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_JobsByStatus(count_jobs))
        self.samples_processed = Counter(
            "bnrecal_samples_processed", "Calibration samples processed by jobs.", registry=self.registry
        )
        self.upload_bytes = Counter("bnrecal_upload_bytes", "Bytes received in blob uploads.", registry=self.registry)
        self.uploads_rejected = Counter(
            "bnrecal_uploads_rejected", "Uploads refused for exceeding the byte cap.", registry=self.registry
        )
        self.job_seconds = Histogram(
            "bnrecal_job_seconds",
            "Wall time of finished job runs, by final status.",
            labelnames=["status"],
            buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, float("inf")),
            registry=self.registry,
        )

        self.corrupt_blobs = Counter(
            "bnrecal_corrupt_blobs",
            "Stored blobs (or cached copies) found not to hash to their digest, by what found them "
            "(download, job, submission, scrub); each was quarantined.",
            labelnames=["found_by"],
            registry=self.registry,
        )
        self.scrub_blobs = Counter(
            "bnrecal_scrub_blobs", "Stored blobs the scrub re-hashed.", registry=self.registry
        )
        self.scrub_bytes = Counter("bnrecal_scrub_bytes", "Bytes the scrub read and hashed.", registry=self.registry)
        self.scrub_last_completed = Gauge(
            "bnrecal_scrub_last_completed_timestamp_seconds",
            "When the last full scrub of the blob store ended (Unix time; 0: none yet).",
            registry=self.registry,
        )

    def count_corrupt(self, found_by: str) -> None:
        """Count a blob found corrupt (the blob store's hook)."""
        self.corrupt_blobs.labels(found_by=found_by).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
