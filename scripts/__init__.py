"""Scripts behind the Makefile targets; importable (`from scripts import demo`) by tests and benchmarks."""
