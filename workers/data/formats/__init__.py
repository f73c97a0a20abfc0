"""The formats calibration data comes in, each read row range by row range through where its
bytes live (``workers.data.storage``), never knowing whether that is a disk or S3: arrays
(``arrays``), image folders (``images``), archives of images unpacked once (``archive``),
Parquet and Arrow (``columnar``), WebDataset tars (``webdataset``), MosaicML Streaming's MDS
shards (``mds``), a user's Python dataset (``loader``), each declaring how it is detected (a
``FileFormat``) or read as shards (a ``ShardFormat``); and how an encoded image becomes a
tensor (``transform``). Datasets of shards stand above."""
