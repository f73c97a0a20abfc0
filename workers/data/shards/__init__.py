"""Datasets of shards (WebDataset tars, Parquet, ``save_to_disk`` Arrow), streamed: whether a
source is one and its description (``detection``), which shards it is made of (``listing``,
``patterns`` for brace patterns and globs), the bytes of one shard (``reads``), and the
dataset a rank reads them through (``dataset``)."""
