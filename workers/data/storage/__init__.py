"""Where a dataset's bytes live, apart from what they are: object storage (``objectstore``),
a file or byte range of one, local or in S3 (``files``: ``ShardRef``, ``Place``), and reads
of both (``reads``). The bottom of ``workers.data``: the formats read through it."""
