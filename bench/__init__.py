"""Benchmarks, each runnable as ``python -m bench.<name>``; they print their figures."""
