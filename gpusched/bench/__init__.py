"""Benchmark harnesses: one module per benchmark, each returning JSON-safe figures.

:mod:`~gpusched.bench.gavel`, :mod:`~gpusched.bench.philly` and :mod:`~gpusched.bench.latency`
run the simulator (:mod:`gpusched.sim`) on the public traces; :mod:`~gpusched.bench.genetic` and
:mod:`~gpusched.bench.forecast` measure the optimiser and the demand forecast;
:mod:`~gpusched.bench.recovery` times the fault chain; :mod:`~gpusched.bench.report` turns results
into tables and plots. The CLI (``gpusched bench …``, :mod:`gpusched.commands`) only parses
arguments and calls these. Import the modules directly; this package imports nothing. Plots and
progress bars need the ``lab`` extra (:mod:`gpusched.extras`); fleets and request streams come
from :mod:`gpusched.testing`.
"""
