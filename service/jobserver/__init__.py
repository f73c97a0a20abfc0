"""The job server behind ``bnrecal serve``: the ledger of jobs (SQLite or Postgres), the
content-addressed blob store (local files or S3), the runner that leases queued jobs and
drives each in a job host actor, the change feed and event streams, storage collection,
capacity checks and metrics. :class:`server.Services` ties them together for ``api``.

One run's pipeline (``service.run.recalibrate``, the report, the export) stays in ``service``,
shared with the CLI and the Python API; nothing there imports this package.
"""
