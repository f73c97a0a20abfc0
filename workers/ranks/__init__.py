"""The ranks: the Ray side of a calibration job.

It owns the rank actor (``actor``), the driver's side of a group of K ranks with their
placement, progress and faults (``group``), the warm pool of rank actors kept between
jobs (``pool``), what every rank is told (``plan``), the deterministic sharding rule
(``sharding``), the real ``ray.util.collective`` allreduce (``collectives``), the rank
processes' allocator settings (``allocator``) and their start-up (``start_up``). It is the top room of ``workers`` and may
import every other one (``data``, ``engine``, ``models``, ``programs``); nothing below
imports it.
"""
