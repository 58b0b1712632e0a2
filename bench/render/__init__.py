"""The reports, rendered from the results CSVs (the bench schema, bench/conftest.py), with one set of cells.

- :mod:`~render.table`: what the renderers share: CSV rows, the row index, number and ratio cells, table heads;
- :mod:`~render.suite`: the pytest suite's ``summary.md`` and plots (``python bench/report.py [CSV]``,
  ``prefixattn bench``);
- :mod:`~render.gpu`: the GPU check's ``.md`` beside its CSV and a README section from one run
  (``python bench/gpu_report.py CSV [--steps ...]``);
- :mod:`~render.performance`: docs/performance.md and the README's headline table from every committed run
  (``python bench/perf_page.py --write | --check``).

The commands are the thin scripts named above, kept at their documented paths; the generated pages name them.
"""
