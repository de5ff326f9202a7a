"""Benchmarks (run as ``python -m bench.<name>``); results in bench/results/."""
