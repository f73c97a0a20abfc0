"""Datasets of shards (WebDataset tars, Parquet, ``save_to_disk`` Arrow, MDS), streamed, above
the formats they hold: whether a source is one and its description (``detection``), which
shards it is made of (``listing``, ``patterns`` for brace patterns and globs), the formats of
shards there are (``shard_formats``), and the dataset a rank reads them through
(``dataset``). A shard's bytes are read through ``workers.data.storage``."""
