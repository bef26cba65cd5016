"""How an elastic MPIJob's status is judged (issue 35): a worker restarted in place (restartPolicy OnFailure: an OOM
kill, a crash) is an event, not a failure; a transient image pull on a recreated worker never fails a job that
ran; a fixed-size job keeps today's judgement. Pods in the API's camelCase form, the MPIJob as the operator
renders it."""

from __future__ import annotations

from typing import Any

from operators import mpijob_status as st
from operators.mpijob_spec import JOB_ROLE_LABEL, MPIJobConfig, TaskIdentity, build_mpijob

TRAIN = ["python", "-m", "nightshift.train", "--epochs", "5"]
IDENTITY = TaskIdentity(dag_id="nightly", task_id="train", run_id="manual__1", try_number=1)
NOW = 1_800_000_000.0


def job(*, elastic: bool) -> dict[str, Any]:
    config = MPIJobConfig(image="trainer:1", command=TRAIN, num_workers=3,
                          min_workers=1 if elastic else None, network_interfaces="eth0" if elastic else None)
    body = build_mpijob(config, IDENTITY)
    body["status"] = {"conditions": [
        {"type": "Created", "status": "True"},
        {"type": "Running", "status": "True", "lastTransitionTime": "2027-01-15T08:00:00Z"}]}
    return body


def stamp(seconds_ago: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(NOW - seconds_ago, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name: str, role: str, *, restarts: int = 0, last: str | None = None, waiting: str | None = None,
        scheduled_ago: float = 3600.0) -> dict[str, Any]:
    status: dict[str, Any] = {"name": "worker", "image": "trainer:1", "restartCount": restarts,
                              "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}}}
    if last:
        status["lastState"] = {"terminated": {"reason": last, "exitCode": 137}}
    return {"metadata": {"name": name, "labels": {JOB_ROLE_LABEL: role}, "creationTimestamp": stamp(7200)},
            "status": {"phase": "Pending" if waiting else "Running", "containerStatuses": [status],
                       "conditions": [{"type": "PodScheduled", "status": "True",
                                       "lastTransitionTime": stamp(scheduled_ago)}]}}


def look(body: dict[str, Any], pods: list[dict[str, Any]], elapsed: float = 1000.0) -> st.Verdict:
    return st.evaluate("j", body, pods, elapsed=elapsed, startup_timeout=600, now=NOW)


LAUNCHER = pod("j-launcher", "launcher")


def test_an_elastic_worker_restarted_in_place_after_an_oom_kill_is_an_event_not_a_failure() -> None:
    restarted = pod("j-worker-1", "worker", restarts=1, last="OOMKilled")
    verdict = look(job(elastic=True), [LAUNCHER, pod("j-worker-0", "worker"), restarted])
    assert not verdict.done and not verdict.failed
    assert verdict.message == "MPIJob j runs; elastic worker restarts: j-worker-1 x1 (last: OOMKilled, exit code 137)"
    # a fixed-size job keeps today's judgement: its workers do not restart, an OOM kill fails it
    fixed = look(job(elastic=False), [LAUNCHER, restarted])
    assert fixed.done and fixed.error_kind == st.OOM_KIND


def test_an_elastic_worker_in_a_crash_loop_fails_the_job_naming_it() -> None:
    looping = pod("j-worker-2", "worker", restarts=st.ELASTIC_RESTART_LIMIT + 1, last="OOMKilled",
                  waiting="CrashLoopBackOff")
    verdict = look(job(elastic=True), [LAUNCHER, looping])
    assert verdict.done and verdict.error_kind == st.OOM_KIND
    assert f"elastic worker pod j-worker-2 restarted {st.ELASTIC_RESTART_LIMIT + 1} times" in verdict.message
    assert look(job(elastic=True), [LAUNCHER, pod("j-worker-2", "worker", restarts=st.ELASTIC_RESTART_LIMIT,
                                                  last="Error", waiting="CrashLoopBackOff")]).done is False
    # many restarts over a long job, each recovered from (running now): not a crash loop
    assert look(job(elastic=True), [LAUNCHER, pod("j-worker-2", "worker", restarts=20, last="OOMKilled")]).done is False


def test_a_later_failure_of_an_elastic_job_is_not_blamed_on_an_oom_it_recovered_from() -> None:
    body = job(elastic=True)
    body["status"]["conditions"].append({"type": "Failed", "status": "True", "reason": "MPIJobEvicted",
                                         "message": "worker pod evicted"})
    verdict = look(body, [LAUNCHER, pod("j-worker-1", "worker", restarts=1, last="OOMKilled")])
    assert verdict.done and verdict.error_kind == st.FAILED_KIND and "MPIJobEvicted" in verdict.message


def test_a_recreated_worker_pulling_its_image_never_fails_a_job_that_ran() -> None:
    for reason in ("ErrImagePull", "ImagePullBackOff"):
        replacement = pod("j-worker-1", "worker", waiting=reason, scheduled_ago=60)
        for elastic in (True, False):
            verdict = look(job(elastic=elastic), [LAUNCHER, pod("j-worker-0", "worker"), replacement],
                           elapsed=10_000)
            assert not verdict.done, (reason, elastic, verdict)
        # an elastic job names the worker it waits for
        running = look(job(elastic=True), [LAUNCHER, replacement], elapsed=10_000)
        assert f"cannot pull image trainer:1: {reason}" in running.message


def test_a_job_that_never_ran_waits_out_the_kubelets_pull_back_off_before_failing() -> None:
    body = job(elastic=True)
    body["status"] = {"conditions": [{"type": "Created", "status": "True"}]}
    # counted from when the pod was scheduled (a late-scheduled pod gets the whole back-off), not from the submit
    fresh = [pod("j-launcher", "launcher", waiting="ImagePullBackOff", scheduled_ago=st.IMAGE_PULL_GRACE_S - 10)]
    assert not look(body, fresh, elapsed=st.IMAGE_PULL_GRACE_S - 100).done
    pending = [pod("j-launcher", "launcher", waiting="ImagePullBackOff", scheduled_ago=st.IMAGE_PULL_GRACE_S + 1)]
    late = look(body, pending, elapsed=st.IMAGE_PULL_GRACE_S)
    assert late.done and late.error_kind == st.IMAGE_PULL_KIND and "kubelet's back-off" in late.message
    # a name no registry can ever serve fails at once
    wrong = look(body, [pod("j-launcher", "launcher", waiting="InvalidImageName", scheduled_ago=1)], elapsed=1)
    assert wrong.done and wrong.error_kind == st.IMAGE_PULL_KIND


def test_a_suspended_job_has_not_run_so_a_bad_image_still_fails_it() -> None:
    """Review: a Kueue job is created suspended, and the MPI Operator writes Running=False (MPIJobSuspended): that
    is no run."""
    body = job(elastic=False)
    body["status"] = {"conditions": [{"type": "Created", "status": "True"},
                                     {"type": "Running", "status": "False", "reason": "MPIJobSuspended"}]}
    wrong = look(body, [pod("j-launcher", "launcher", waiting="InvalidImageName", scheduled_ago=1)], elapsed=1)
    assert wrong.done and wrong.error_kind == st.IMAGE_PULL_KIND


def test_a_launcher_that_cannot_pull_for_long_after_the_job_ran_fails_it() -> None:
    stuck = pod("j-launcher-2", "launcher", waiting="ImagePullBackOff", scheduled_ago=st.IMAGE_PULL_AFTER_RUN_S + 1)
    for elastic in (True, False):
        verdict = look(job(elastic=elastic), [pod("j-worker-0", "worker"), stuck])
        assert verdict.done and verdict.error_kind == st.IMAGE_PULL_KIND, (elastic, verdict)
