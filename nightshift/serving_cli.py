"""`nightshift evaluate`, `nightshift register`, `nightshift deploy`: the last three steps as commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError
from nightshift.tasks import MULTICLASS, TASKS

DEFAULT_MODEL_NAME = "nightshift-digits"


def _pairs(values: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} {item!r} must look like KEY=VALUE")
        out[key] = value
    return out


def _run_id(args: argparse.Namespace) -> str:
    if args.run_id:
        return str(args.run_id)
    if args.out:
        from nightshift.train.artifacts import RUN_RECORD

        record = Path(args.out) / RUN_RECORD
        try:
            return str(json.loads(record.read_text())["run_id"])
        except (OSError, ValueError, KeyError) as err:
            raise UsageError(f"{record} has no run_id ({err}); pass --run-id") from err
    raise UsageError("pass --run-id RUN_ID or --out TRAINING_OUTPUT_DIR")


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", help="MLflow run id of the training run")
    parser.add_argument("--out", help="training output directory holding mlflow_run.json "
                                      "(instead of --run-id)")
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="registered model name")


def _evaluate(args: argparse.Namespace) -> int:
    from nightshift.cli import emit
    from nightshift.evaluate import GateConfig, evaluate

    guards = {k: float(v) for k, v in _pairs(args.guard, "--guard").items()} if args.guard else None
    gate = GateConfig(primary=args.primary or "", min_improvement=args.min_improvement, floor=args.floor,
                      guards=guards, task=args.task, positive_class=args.positive_class)
    result = evaluate(_run_id(args), data_dir=args.data, model_name=args.model_name, split=args.split,
                      gate=gate, label_column=args.label_column)
    emit(result)
    if result.get("needs_approval"):
        return 3  # the champion could not be compared: a person decides (the reasons say why)
    return 0 if result["passed"] else 1


def _register(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.registry import register

    evaluation = json.loads(Path(args.evaluation).read_text()) if args.evaluation else None
    return register(_run_id(args), model_name=args.model_name, lineage=_pairs(args.lineage, "--lineage"),
                    evaluation=evaluation, alias=args.alias)


def _deploy(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.deploy import deploy

    if args.stop:
        from nightshift.deploy.local import stop_local

        return stop_local(args.model_name)
    options: dict[str, Any] = {}
    api = None
    if args.target == "kserve":
        from kubernetes import client, config

        config.load_kube_config() if args.kubeconfig_context is None else config.load_kube_config(
            context=args.kubeconfig_context)
        api = client.CustomObjectsApi()
        options.update(canary_traffic_percent=args.canary_percent, storage=args.storage_uri,
                       timeout=args.timeout)
    else:
        options.update(tolerance=args.tolerance, canary_rows=args.canary_rows, startup_timeout=args.timeout,
                       server=args.server)
    return deploy(args.target, args.model_name, version=args.version, alias=args.alias, data_dir=args.data,
                  kserve_api=api, namespace=args.namespace, **options)


def add_parser(subparsers: Any) -> None:
    ev = subparsers.add_parser("evaluate", help="score the new model and @champion; print the gate decision "
                                                "(exit 1 when the gate rejects; 3 when the champion could not "
                                                "be compared and a person must decide)")
    _add_run(ev)
    ev.add_argument("--data", required=True, help="staged dataset directory")
    ev.add_argument("--split", default="test")
    ev.add_argument("--task", choices=TASKS, default=MULTICLASS,
                    help=f"what the model predicts: which metrics are computed and gated ({MULTICLASS})")
    ev.add_argument("--label-column", default="label", help="the split's target column (label)")
    ev.add_argument("--primary", default=None,
                    help="gate metric (default: the task's, accuracy for classification, rmse for regression)")
    ev.add_argument("--min-improvement", type=float, default=0.001)
    ev.add_argument("--floor", type=float, default=None,
                    help="primary metric needed when there is no champion (default: the task's, 0.8 for "
                         "classification, none for regression)")
    ev.add_argument("--guard", action="append", metavar="METRIC=TOLERANCE",
                    help="guard metric and the regression it may show (repeatable; default: the task's)")
    ev.add_argument("--positive-class", metavar="LABEL",
                    help="binary: the label value F1, precision and recall are computed for, as the label column "
                         "writes it (default: the second of the sorted labels, e.g. 1 of 0/1)")
    ev.set_defaults(func=_evaluate)

    reg = subparsers.add_parser("register",
                                help="register the run's model with lineage and alias @challenger")
    _add_run(reg)
    reg.add_argument("--evaluation",
                     help="JSON file `nightshift evaluate` printed; a rejected one registers nothing")
    reg.add_argument("--lineage", action="append", metavar="KEY=VALUE",
                     help="lineage tag, e.g. dataset_version=…, dag_id=…, dag_run_id=… (repeatable)")
    reg.add_argument("--alias", default="challenger")
    reg.set_defaults(func=_register)

    dep = subparsers.add_parser("deploy",
                                help="deploy a registered version and move @champion when it answers")
    from nightshift.deploy import target_names

    dep.add_argument("--target", choices=target_names(), default="local",
                     help="where to serve it: a deployment target of nightshift.deploy (built-in or a plugin's)")
    dep.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    dep.add_argument("--version", help="model version (default: the one @--alias)")
    dep.add_argument("--alias", default="challenger")
    dep.add_argument("--data", help="staged dataset directory (local target: the canary batch)")
    dep.add_argument("--tolerance", type=float, default=0.05, help="canary accuracy below evaluated allowed")
    dep.add_argument("--canary-rows", type=int, default=256)
    dep.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for health / Ready")
    dep.add_argument("--server", choices=("mlflow", "guarded"), default="mlflow",
                     help="local: `mlflow models serve` as is, or MLflow's scoring app behind a request guard "
                          "(415 without Content-Type, 413 above 2 MiB, short error bodies)")
    dep.add_argument("--namespace", default="default")
    dep.add_argument("--canary-percent", type=int, default=10)
    dep.add_argument("--storage-uri", help="kserve: storage URI overriding the registry's artifact location")
    dep.add_argument("--kubeconfig-context")
    dep.add_argument("--stop", action="store_true", help="local: stop the model server and forget its record")
    dep.set_defaults(func=_deploy)
