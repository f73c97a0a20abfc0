"""How a rank reads its share: the order samples are taken in (``order``), data that reaches
the ranks through Ray's object store (``shipping``), batches decoded ahead (``batches``),
what a rank keeps so a job reads its data once (``kept``), and whether two passes read the
same samples (``alignment``)."""
