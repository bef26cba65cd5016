"""Data: the demo dataset, validation (Great Expectations) and staging (DVC)."""
