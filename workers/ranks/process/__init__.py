"""What runs in a rank's own process: the Ray actor (``actor``), a rank's work, which also
runs in the calling process for a run of one (``work``), its collective (``ray_collective``),
what it keeps for a job's scope (``scoped``), and its process's allocator settings
(``allocator``) and start-up (``start_up``). It imports nothing of ``gangs``."""
