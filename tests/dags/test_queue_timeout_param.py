"""nightly_retrain gives the training job a queue timeout by default (a Param), so that a job Kueue never admits
fails the try with the reason instead of holding the run for the task's whole execution_timeout."""

from __future__ import annotations

import sys
from dataclasses import replace

from tests.dags.conftest import REPO


def test_nightly_retrain_passes_a_default_queue_timeout_to_the_training_job(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("NIGHTSHIFT_HOME", "/workspace")
    monkeypatch.syspath_prepend(str(REPO / "dags"))  # as Airflow puts the DAG folder on sys.path
    sys.modules.pop("nightly_retrain", None)
    import nightly_retrain

    default = nightly_retrain.dag.params.get_param("queue_timeout").value
    assert isinstance(default, int) and default > 0
    for given, seconds in ((default, float(default)), (None, None)):  # None: emptied in the form, no limit
        train = nightly_retrain.dag.get_task("train")
        train.queue_timeout = train.execution.queue_timeout  # the template, as the DAG file declares it
        assert train.queue_timeout == "{{ params.queue_timeout }}"
        # Only this field: the others need a task instance's XComs.
        train._do_render_template_fields(train, ("queue_timeout",), {"params": {"queue_timeout": given}},
                                         train.get_template_env(), set())
        # What settle() does with the execution config (the others' templates need a task instance).
        assert replace(train.execution, queue_timeout=train.queue_timeout).settled().queue_timeout == seconds
