"""Benchmarks that print markdown tables and write JSON to benchmarks/results/.

Run them from the repo root as modules, e.g. ``python -m benchmarks.cpu_bench --help``; they import
``nvdcp`` and ``nvdcp.testing`` (the reliability kit shared with tests/), never ``tests``.
"""
