"""How a rank reads its share, above the formats and the shards: data that reaches the ranks
through Ray's object store (``shipping``), batches decoded ahead (``batches``), what a rank
keeps so a job reads its data once (``kept``), a CUDA rank's decoding on its device
(``device_decode``), and whether two passes read the same samples (``alignment``). The
samples' order itself is ``workers.data.order``, beneath every room."""
