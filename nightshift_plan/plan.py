"""What a `nightly_retrain` run would submit to Kubernetes, rendered without a cluster (`nightshift plan`).

This module sits above the DAGs (it loads dags/nightly_retrain.py by path and imports nightly_tasks) and the
operators; nothing in dags/, operators/ or nightshift/ imports it (tests/unit/test_layers.py).

The DAG file is imported as Airflow would import it, the trigger conf is checked by the DAG's own Params
(unknown keys refused too), and the `train` task's templates are rendered with that run's params and a
staged dataset standing in for `stage_dataset`'s result. The MPIJob is built by the same code path the
operator runs at execute, so the plan is what the cluster would receive.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from operators.backends import AUTO, backend_class
from operators.errors import InvalidJobConfig

REPO = Path(__file__).resolve().parents[1]
DAGS_DIR = REPO / "dags"
DAG_FILE = "nightly_retrain.py"
TRAIN_TASK = "train"
PLAN_RUN_ID = "manual__plan"
# What stage_dataset would return; the hash is known only once the data has been versioned.
DATASET_VERSION_PLACEHOLDER = "md5:dataset-version"
CODE_VERSION_PLACEHOLDER = "code-version"  # the git commit check_changes records at run time


class PlanError(ValueError):
    """The trigger conf (or what it asks for) cannot become a run; the message names the key."""


def load_dag(dags_dir: Path = DAGS_DIR, dag_file: str = DAG_FILE) -> Any:
    """The DAG object of `dag_file`, imported with the DAG folder on sys.path (as Airflow puts it)."""
    if str(dags_dir) not in sys.path:
        sys.path.insert(0, str(dags_dir))
    spec = importlib.util.spec_from_file_location(f"nightshift_plan_{Path(dag_file).stem}", dags_dir / dag_file)
    if spec is None or spec.loader is None:
        raise PlanError(f"cannot import {dags_dir / dag_file}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from nightly_tasks.factory import InvalidPipelineDag

    if isinstance(module.dag, InvalidPipelineDag):  # the declaration's one-line problem, as Airflow shows it
        raise PlanError(str(module.dag.problem))
    return module.dag


def effective_params(dag: Any, conf: Mapping[str, Any]) -> dict[str, Any]:
    """The run's params: the conf over the DAG's defaults, validated by each Param's own schema."""
    from airflow.sdk.exceptions import ParamValidationError

    unknown = sorted(set(conf) - set(dag.params))
    if unknown:
        raise PlanError(f"unknown conf key(s) {', '.join(unknown)}; {dag.dag_id} takes: {', '.join(dag.params)}")
    params = copy.deepcopy(dag.params)
    try:
        params.update(dict(conf))
        return dict(params.validate())
    except ParamValidationError as err:  # its first line names the param and what is wrong
        raise PlanError(str(err).splitlines()[0]) from err


class _StagedTI:
    """Stands in for the task instance in templates: `xcom_pull` answers with what stage_dataset returns, and
    check_changes's `training` (the trainer options resolved from the params, as that task resolves them)."""

    def __init__(self, dag_id: str, run_id: str, task_id: str, params: Mapping[str, Any]) -> None:
        from nightly_tasks.factory import pipeline_for
        from nightly_tasks.steps import training_options

        from nightshift.errors import UsageError
        from nightshift.search.best import training_defaults

        self.dag_id, self.run_id, self.task_id = dag_id, run_id, task_id
        self.try_number, self.map_index = 1, -1
        pipeline = pipeline_for(dag_id)
        try:  # what check_changes resolves (nightly_tasks.steps.resolve_training), without its log lines;
            # resolved before any template renders, so a bad value is one line, not a rendering error
            resolved = (training_options(pipeline, dict(params)) if pipeline is not None
                        else training_defaults(dict(params)))
        except UsageError as err:  # a malformed best.json, or model_kwargs text that is no JSON object
            raise PlanError(str(err)) from err
        self.training = {**resolved["options"], "summary": resolved["summary"]}

    def xcom_pull(self, task_ids: str | None = None, key: str = "return_value", **_: Any) -> Any:
        if task_ids == "check_changes" and key == "training":
            return self.training
        if task_ids == "check_changes" and key == "fingerprint":
            return {"code_version": CODE_VERSION_PLACEHOLDER}
        if task_ids != "stage_dataset" or key != "return_value":
            return None
        from nightly_tasks.steps import workspace_for

        workspace = workspace_for(self.dag_id, self.run_id)
        return {"path": str(workspace / "data"), "workspace": str(workspace), "hash": DATASET_VERSION_PLACEHOLDER}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan_explained` found: the objects, and the namespace they go to with where it came from (None when
    the backend creates no object)."""

    objects: list[dict[str, Any]]
    namespace: str | None = None
    namespace_source: str | None = None


def namespace_source(task: Any, namespace: str) -> str:
    """Where `namespace`, what the rendered `task` resolves (HorovodKubernetesOperator.resolve_namespace), comes
    from: the task's `cluster.namespace`, else the namespace of its Airflow connection, else the default."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    conn_id = task.cluster.kubernetes_conn_id
    expected: str | None = None
    if task.cluster.namespace:
        expected, source = task.cluster.namespace, f"from the {task.task_id} task's cluster.namespace"
    else:
        try:
            # KubernetesHook answers a missing kubernetes_default with an empty connection: ask Airflow itself
            BaseHook.get_connection(conn_id)
        except AirflowNotFoundException:
            source = f"the default: no cluster.namespace and no Airflow connection {conn_id}"
        else:
            expected = task.hook.get_namespace()
            source = (f"from Airflow connection {conn_id}" if expected
                      else f"the default: no cluster.namespace, and Airflow connection {conn_id} names none")
    if (expected or "default") != namespace:  # the operator resolved it otherwise than this reads it
        source = f"as the {task.task_id} task resolves it"
    return source


def plan(conf: Mapping[str, Any], *, run_id: str = PLAN_RUN_ID, dag: Any = None) -> list[dict[str, Any]]:
    """Every Kubernetes object a run with `conf` creates, in creation order (none on a backend that submits no
    MPIJob, such as local; `auto` is planned as kubernetes, what it is where the cluster connection exists)."""
    return plan_explained(conf, run_id=run_id, dag=dag).objects


def plan_explained(conf: Mapping[str, Any], *, run_id: str = PLAN_RUN_ID, dag: Any = None) -> Plan:
    """`plan`'s objects, with their namespace and where it came from (`namespace_source`)."""
    dag = dag if dag is not None else load_dag()
    params = effective_params(dag, conf)
    name = str(params.get("backend") or AUTO)
    kind = backend_class("kubernetes" if name == AUTO else name)
    if not kind.renders_mpijob:
        return Plan([])
    from operators.horovod import HorovodKubernetesOperator

    task = copy.deepcopy(dag.get_task(TRAIN_TASK))
    if not isinstance(task, HorovodKubernetesOperator):
        raise PlanError(f"{dag.dag_id}.{TRAIN_TASK} is a {type(task).__name__}, not a HorovodKubernetesOperator")
    ti = _StagedTI(dag.dag_id, run_id, TRAIN_TASK, params)
    context = {"params": params, "run_id": run_id, "dag": dag, "ti": ti, "task_instance": ti, "task": task}
    task.render_template_fields(context)  # type: ignore[arg-type]
    try:
        task.settle()
        backend = task.make_backend("kubernetes" if name == AUTO else name)
        task.check_elastic(backend)  # as execute refuses before submitting: elastic with Kueue, say
        # The namespace as the task resolves it: cluster.namespace, else the connection's, else "default".
        namespace = backend.run.namespace()
        return Plan([backend.render(task.identity_from(context), namespace)], namespace,
                    namespace_source(task, namespace))
    except InvalidJobConfig as err:
        raise PlanError(f"{TRAIN_TASK}: {err}") from err


def placeholders(objects: list[dict[str, Any]]) -> list[str]:
    """The stand-in values a plan holds (known only once a run staged its data or recorded its commit)."""
    import json

    text = json.dumps(objects)
    return [f"{value} ({what})" for value, what in (
        (DATASET_VERSION_PLACEHOLDER, "the dataset version stage_dataset records"),
        (CODE_VERSION_PLACEHOLDER, "the git commit check_changes records"),
    ) if value in text]


def validate_all(objects: list[dict[str, Any]]) -> list[str]:
    """Validate every object strictly against its published CRD (raises ManifestInvalid); return the kinds
    that could not be checked because no schema was found."""
    from operators.validation import validate

    return [f"{o.get('kind')} {(o.get('metadata') or {}).get('name')}" for o in objects if not validate(o)]


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')} {meta.get('namespace', '-')}/{meta.get('name')}"


def diff(before: list[dict[str, Any]], after: list[dict[str, Any]], before_label: str, after_label: str) -> str:
    """A unified diff of each object, matched by kind, namespace and name; empty when nothing changed."""
    import difflib

    import yaml

    old = {object_key(o): yaml.safe_dump(o, sort_keys=False).splitlines() for o in before}
    new = {object_key(o): yaml.safe_dump(o, sort_keys=False).splitlines() for o in after}
    parts: list[str] = []
    for key in [*old, *(k for k in new if k not in old)]:
        lines = difflib.unified_diff(old.get(key, []), new.get(key, []), f"{before_label}: {key}",
                                     f"{after_label}: {key}", lineterm="", n=3)
        parts.extend(lines)
    return "\n".join(parts) + ("\n" if parts else "")


def plan_at_ref(ref: str, conf: Mapping[str, Any], run_id: str, repo: Path = REPO) -> list[dict[str, Any]]:
    """The plan that the code at git `ref` renders, run from a temporary worktree of it."""
    import json
    import os
    import subprocess
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory(prefix="nightshift-plan-") as tmp:
        tree = Path(tmp) / "tree"
        added = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree), ref],
                               capture_output=True, text=True, check=False)
        if added.returncode != 0:
            raise PlanError(f"cannot check out {ref!r}: {added.stderr.strip().splitlines()[-1:]}")
        try:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run([sys.executable, "-m", "nightshift.cli", "plan", "--conf", json.dumps(dict(conf)),
                                   "--run-id", run_id], cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=300, check=False)
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                           capture_output=True, check=False)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PlanError(f"the plan at {ref} failed: {reason}")
    return [o for o in yaml.safe_load_all(done.stdout) if o]


def render_yaml(objects: list[dict[str, Any]], namespace_source: str | None = None) -> str:
    """The objects as YAML documents; with `namespace_source`, each object's `metadata.namespace` line says where
    the namespace came from, in a comment beside it."""
    import yaml

    if not objects:
        return "# this run's backend creates no Kubernetes objects (backend=local: horovodrun on the Airflow worker)\n"
    text = yaml.safe_dump_all(objects, sort_keys=False)
    if not namespace_source:
        return text
    lines, in_metadata = [], False
    for line in text.splitlines():
        if line == "---" or (line and not line.startswith((" ", "- "))):  # a document or a top-level key begins
            in_metadata = line == "metadata:"
        elif in_metadata and line.startswith("  namespace: "):
            line += f"  # {namespace_source}"
        lines.append(line)
    return "\n".join(lines) + "\n"
