"""The job server behind ``bnrecal serve``, in rooms: ``jobs/`` (the spec, the runner that
leases queued jobs and drives each, the change feed and event streams, leases between
replicas), ``ledger/`` (every job in SQL: SQLite or Postgres), ``storage/`` (the
content-addressed blob store on local files or S3, collection, the scrub, a full disk) and
``cluster/`` (capacity checks, the cluster's health, the job host actor). At the top:
:class:`server.Services`, which ties them together for ``api``, problem+json
(``problems``), metrics and the background-chore loop (``periodic``).

One run's pipeline (``service.run.recalibrate``, the report, the export) stays in ``service``,
shared with the CLI and the Python API; nothing there imports this package.
"""
