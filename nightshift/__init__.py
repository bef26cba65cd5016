"""Nightshift: the pure ML library behind the nightly_retrain DAG (no Airflow imports here)."""

from __future__ import annotations

__version__ = "0.1.0"
