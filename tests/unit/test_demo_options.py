"""`make demo DEMO_ARGS=...`: the options of scripts/demo.py that the pages show (docs/getting-started.md)."""

from __future__ import annotations

import pytest

from nightshift.errors import UsageError
from scripts.demo import choose_run1_backend

FINE = {"lacking": [], "tracking_uri": "sqlite:////h/mlflow.db"}
NO_ROOT = {"lacking": ["root (network namespaces and mounts)"], "tracking_uri": "sqlite:////h/mlflow.db"}


def test_run1_backend_auto_is_the_machines_choice_and_local_is_local_anywhere() -> None:
    assert choose_run1_backend("auto", **FINE)[0] == "hosts"
    assert choose_run1_backend("auto", **NO_ROOT)[0] == "local"
    assert choose_run1_backend("local", **FINE) == ("local", "asked for with --backend local")
    assert choose_run1_backend("hosts", **FINE)[0] == "hosts"


def test_run1_backend_hosts_where_the_machine_cannot_is_refused_saying_why() -> None:
    with pytest.raises(UsageError, match=r"--backend hosts: emulated hosts need root .*use --backend local or auto"):
        choose_run1_backend("hosts", **NO_ROOT)
