"""The Ray cluster as the server sees it: whether a job could ever be placed (``capacity``),
whether the cluster answers (``health``), and the job host actor where jobs run their
driver work (``job_host``)."""
