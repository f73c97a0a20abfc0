"""The ranks: the Ray side of a calibration job.

At this level, what the driver and the ranks share and the driver's side: what every rank
is told and returns (``plan``), the events it streams (``events``) and how the driver reads
them (``streams``), the deterministic sharding rule (``sharding``), a group of K ranks with
their placement, progress and faults (``group``) and a later phase's work handed to them
(``offload``). Three rooms below: ``process`` (what runs in a rank's own process: the actor,
its work, its collective, what it keeps), ``gangs`` (the rank actors kept and handed out:
the warm pool, a job's gang) and ``ort`` (the onnxruntime passes a rank runs). It is the top
room of ``workers`` and may import every other one (``data``, ``engine``, ``models``,
``programs``); nothing below imports it.
"""
