"""Benchmarks: each `bench/bench_*.py` has `main() -> None` and prints ratios measured side by side."""
