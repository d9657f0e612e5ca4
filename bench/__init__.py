"""Benchmarks; run each from the repository root as ``python -m bench.bench_NAME`` (or ``dynamix-hvd bench NAME``)."""
