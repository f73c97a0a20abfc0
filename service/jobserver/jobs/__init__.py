"""Jobs and their queue: the job spec, statuses and resource (``spec``), a job's inputs
made into the engine's request (``inputs``), the runner that drains the queue onto Ray
fairly (``runner``), the driver work a job does (``work``), its progress (``progress``),
its events and change streams (``events``, ``ledger_watch``), and the leases that let
replicas share one queue (``leases``)."""
