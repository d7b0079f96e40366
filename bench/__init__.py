"""Benchmarks: each module measures one part against a baseline taken in the same run.

Run them all with ``make bench`` (``python -m bench.run_all``) or one with
``python -m bench.<module> [--quick]``. Results are JSON files in ``docs/benchmarks/`` and PNG
plots in ``docs/img/`` (quick runs: ``var/bench/quick/``) unless ``--out-dir`` / ``--img-dir`` say
otherwise; ``docs/benchmarks.md`` reads them. Timings are never asserted anywhere: only ratios
measured side by side mean something on a shared machine.
"""
