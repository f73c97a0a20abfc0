"""onnxruntime passes on the ranks (INT8 ranges, accuracy checks): one rank's pass over its
shard (``rank_pass``), a session run in pieces of bounded memory (``pieces``), and the
driver's side, K ranks and their gathered result (``group``)."""
