"""Sweeps (docs/sweeps.md): many models over many named calibration sets in one run, each
cell the single job of its model and set, on ranks and decoded samples the cells share.

``cells`` (what a sweep is made of), ``inputs`` (the command line's manifest, sets and
pairs, checked before any work), ``running`` (a sweep of files), ``matrix`` (the matrix
report: JSON, CSV, HTML). The Python API's ``recalibrate_many`` is ``service.live.many``.
"""
