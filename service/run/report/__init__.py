"""A run's report: the typed ``report.json`` and its timeline (``document``), the
self-contained HTML page (``page``) and its charts, drawn beside the run (``charts``)
(docs/report.md). It imports ``service.export``'s report sections and ``service.run.options``,
nothing else of the run."""
