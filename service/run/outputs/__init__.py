"""The phases of a run after its statistics, which make its exported files (docs/onnx.md,
docs/int8.md): what a surface asks for and the phases that make it (``later_phases``:
``RunOutputs``, ``make_outputs``), the exports traced on a rank (``exports``), the INT8
phase (``int8``: ranges, quantizer, checks, guard) and its names checked before any
calibration (``int8_names``), and where their onnxruntime passes run (``onnx_passes``).
The quantizer and the checks themselves are ``service.export.int8``'s; the ranks' side of
the passes is ``workers.ranks.ort``'s."""
