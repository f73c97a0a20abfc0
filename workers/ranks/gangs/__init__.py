"""The rank actors kept and handed out: the warm pool of gangs between jobs (``pool``), the
gang one job holds from its statistics to its last pass (``job_gang``), and a warm pool made
current for the calls in a block (``warm_context``). It builds on ``process`` (the actor)."""
