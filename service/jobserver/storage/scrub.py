"""The scrub: every stored blob re-hashed on a schedule, so damage is found before a job or a
download meets it (docs/storage.md, "Stored bytes are verified").

Part of the storage collection: it runs in a thread of its own every
``BNRECAL_SCRUB_INTERVAL_S`` (0: never), one blob after another, at most
``BNRECAL_SCRUB_BYTES_PER_S`` bytes a second so it never starves jobs of the disk. A blob
whose bytes no longer match is quarantined by the blob store (``HEAD`` 404; the next upload
of the right bytes stores it again) and counted in ``bnrecal_corrupt_blobs{found_by="scrub"}``;
``bnrecal_scrub_blobs``, ``bnrecal_scrub_bytes`` and
``bnrecal_scrub_last_completed_timestamp_seconds`` say what it read. With a shared ledger only
one replica scrubs at a time. In object storage S3's own SHA-256 checksum is compared where the
store keeps one; other objects are downloaded and hashed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from bnrecal.errors import CorruptBlobError, NotFoundError

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.storage.blobs import BlobStore
from bnrecal.service.jobserver.ledger import Ledger
from bnrecal.service.jobserver.ledger.engines import exclusive_turn
from bnrecal.service.jobserver.metrics import ServiceMetrics
from bnrecal.service.jobserver.periodic import Periodic

log = logging.getLogger("bnrecal.scrub")


@dataclass
class ScrubReport:
    """What one pass over the store found: blobs and bytes checked, and the corrupt ones."""

    blobs: int = 0
    bytes: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (tenant, digest)


class BlobScrubber:
    """Re-hashes every stored blob every ``BNRECAL_SCRUB_INTERVAL_S`` seconds, in a daemon thread."""

    def __init__(self, settings: Settings, ledger: Ledger, blobs: BlobStore, metrics: ServiceMetrics | None) -> None:
        self.settings = settings
        self.ledger = ledger
        self.blobs = blobs
        self.metrics = metrics
        self._periodic = Periodic("bnrecal-scrub", settings.scrub_interval_s, self._scrub_once, "the scrub failed", log)

    def start(self) -> None:
        """Scrub every ``BNRECAL_SCRUB_INTERVAL_S`` seconds (not at all if 0); the first pass one interval in."""
        self._periodic.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop scrubbing (between two blobs)."""
        self._periodic.stop(timeout)

    def _scrub_once(self) -> None:
        with exclusive_turn(self.ledger.engine, "blob scrub") as mine:
            if not mine:  # another replica is scrubbing the shared store
                return
            report = self.scrub()
        log.info("scrub: %d blobs, %d bytes checked, %d corrupt", report.blobs, report.bytes, len(report.corrupt))

    def scrub(self) -> ScrubReport:
        """One pass over every tenant's blobs: each re-hashed (quarantined when it no longer
        matches); paced to ``BNRECAL_SCRUB_BYTES_PER_S``."""
        report = ScrubReport()
        pace = self.settings.scrub_bytes_per_s
        began = time.monotonic()
        for tenant in self.blobs.tenants():
            for digest in [blob.digest for blob in self.blobs.stored(tenant)]:
                if self._periodic.stopping:
                    return report
                try:
                    read = self.blobs.scrub(tenant, digest)
                except NotFoundError:  # deleted meanwhile
                    continue
                except CorruptBlobError:
                    report.corrupt.append((tenant, digest))
                    continue
                report.blobs += 1
                report.bytes += read
                if self.metrics is not None:
                    self.metrics.scrub_blobs.inc()
                    self.metrics.scrub_bytes.inc(read)
                if pace:
                    ahead = report.bytes / pace - (time.monotonic() - began)
                    if ahead > 0 and self._periodic.wait(ahead):
                        return report
        if self.metrics is not None:
            self.metrics.scrub_last_completed.set(time.time())
        return report
