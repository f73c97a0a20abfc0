"""Storage: the content-addressed blob stores, on files or S3 (``blobs``), what may be
deleted and when (``collection``), the scrub that re-hashes what is stored (``scrub``), and
a full disk told apart from other failures (``disk``)."""
