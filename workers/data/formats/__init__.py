"""The formats calibration data comes in, each read row range by row range: arrays
(``arrays``), image folders and their labels (``images``, ``labels``), archives of images
unpacked once (``archive``), Parquet and Arrow (``columnar``), WebDataset tars
(``webdataset``), MosaicML Streaming's MDS shards (``mds``), a user's Python dataset
(``loader``); which format a file is (``detect``); and how an encoded image becomes a tensor
(``transform``, ``device_decode``)."""
