"""Command-line interface of the trainer, shared by `python -m nightshift.train` and `nightshift train`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nightshift.cli import json_object
from nightshift.errors import NightshiftError, UsageError
from nightshift.tasks import TASKS
from nightshift.train.config import COMPRESSIONS, DEVICES, PRECISIONS, TrainConfig

if TYPE_CHECKING:
    from nightshift.train.trainer import EpochHook

DEFAULTS = TrainConfig(data=".", out=".", checkpoint_dir=".")  # type: ignore[arg-type]


def _tag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument("--data", required=True, help="staged dataset directory (train/validation/test.parquet)")
    parser.add_argument("--out", required=True, help="where model.pt, model.json, metrics.json(l) go")
    parser.add_argument("--checkpoint-dir", required=True, help="checkpoints; resumed from when restarted")
    parser.add_argument("--model", default=d.model, help=f"registered model name or module:factory ({d.model})")
    parser.add_argument("--model-kwargs", type=json_object, default={}, help="JSON object of model arguments")
    parser.add_argument("--dataset", default=d.dataset, help=f"registered dataset name ({d.dataset})")
    parser.add_argument("--dataset-options", type=json_object, default={},
                        help='JSON object of dataset options, e.g. for tabular {"label": "y", "features": [...]}')
    parser.add_argument("--task", choices=TASKS, default=d.task,
                        help=f"what the model predicts: the loss, validation metric and served answer ({d.task})")
    parser.add_argument("--epochs", type=int, default=d.epochs, help=f"({d.epochs})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help=f"per process ({d.batch_size})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"base learning rate, × world size ({d.lr})")
    parser.add_argument("--momentum", type=float, default=d.momentum, help=f"SGD momentum ({d.momentum})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"({d.seed})")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                        help=f"steps between checkpoints ({d.checkpoint_every})")
    parser.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help=f"({d.keep_checkpoints})")
    parser.add_argument("--log-every", type=int, default=d.log_every,
                        help=f"steps between progress lines ({d.log_every})")
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch threads per process (0: cores / local processes; on resume, the "
                             "checkpoint's count)")
    parser.add_argument("--device", choices=DEVICES, default=d.device,
                        help=f"auto: CUDA when torch sees a GPU, one per local rank, else CPU ({d.device})")
    parser.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                        help=f"bf16/fp16: autocast (fp16 with loss scaling) ({d.precision})")
    parser.add_argument("--compression", choices=COMPRESSIONS, default=d.compression,
                        help=f"gradient compression for the allreduce ({d.compression})")
    parser.add_argument("--code-version", default="",
                        help="the code version this run trains with (part of the checkpoints' resume key); "
                             "default: nightshift.ledger.code_version() (git commit, or a hash of the sources)")
    parser.add_argument("--mlflow-experiment", default=None, help="log the run to this MLflow experiment")
    parser.add_argument("--mlflow-run-name", default=None)
    parser.add_argument("--tag", dest="tags", type=_tag, action="append", default=[], help="KEY=VALUE MLflow tag")
    parser.add_argument("--elastic", action="store_true",
                        help="Horovod elastic training (under horovodrun --min-np/--max-np/--host-discovery-script): "
                             "a lost host rolls back to the last in-memory commit and training goes on with the ranks "
                             "left, an added host receives the state (nightshift.train.elastic)")
    parser.add_argument("--commit-seconds", type=float, default=d.commit_seconds,
                        help=f"elastic: seconds of training between in-memory commits, the point a lost host rolls "
                             f"back to: at most about this much training is redone after a loss, and a host that "
                             f"comes back waits up to this long to be taken in ({d.commit_seconds:g})")
    parser.add_argument("--commit-every", type=int, default=d.commit_every,
                        help="elastic: also commit at least every this many steps (default: by time only)")
    parser.add_argument("--collective-timeout", type=int, default=d.collective_timeout,
                        help=f"elastic: seconds a rank waits on a silent peer before the job resets "
                             f"(HOROVOD_GLOO_TIMEOUT_SECONDS unless set) ({d.collective_timeout})")
    parser.add_argument("--join-timeout", type=int, default=d.join_timeout,
                        help=f"elastic: seconds the ranks wait in hvd.init()'s rendezvous for every process of the "
                             f"round (HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS unless set); a joiner later than that "
                             f"joins the next round, one that never comes is dropped: the pause a late or lost "
                             f"joiner costs ({d.join_timeout})")
    parser.add_argument("--search-storage", default=None,
                        help="model search: the Optuna storage URL of the trial to report to (no password in it)")
    parser.add_argument("--search-study", default=None, help="model search: the study's name")
    parser.add_argument("--search-trial", type=int, default=None,
                        help="model search: the trial's number; rank 0 reports val_accuracy after every epoch "
                             "and the run stops, after a checkpoint, when the study prunes the trial")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        data=args.data, out=args.out, checkpoint_dir=args.checkpoint_dir, model=args.model,
        model_kwargs=args.model_kwargs, dataset=args.dataset, dataset_options=args.dataset_options,
        task=args.task, epochs=args.epochs, batch_size=args.batch_size,
        lr=args.lr, momentum=args.momentum, seed=args.seed, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, log_every=args.log_every, threads=args.threads,
        device=args.device, precision=args.precision, compression=args.compression,
        code_version=args.code_version, mlflow_experiment=args.mlflow_experiment,
        mlflow_run_name=args.mlflow_run_name, tags=dict(args.tags),
        search_storage=args.search_storage, search_study=args.search_study, search_trial=args.search_trial,
        elastic=args.elastic, commit_seconds=args.commit_seconds, commit_every=args.commit_every,
        collective_timeout=args.collective_timeout,
        join_timeout=args.join_timeout,
    )


def run(config: TrainConfig, on_epoch: EpochHook | None = None) -> dict[str, Any]:
    """Load data, join the Horovod job, train; rank 0 returns the summary, others `{}`.

    `on_epoch` (see `Trainer`) is asked after every epoch; with the `search_*` fields and no `on_epoch`,
    the hook reports to that search trial (`nightshift.search.reporter`).
    """
    from nightshift.datasets import load_split
    from nightshift.models import MODELS

    MODELS.get(config.model)  # fail on an unknown model before any process group exists
    from nightshift.errors import DataError
    from nightshift.train.config import data_digest

    if config.elastic:
        # Join first, read the data after: a process Horovod starts for a host that is added or comes back joins
        # ranks that wait for it in hvd.init()'s rendezvous, up to the join timeout (nightshift.train.elastic);
        # reading and hashing a large dataset must not count against it. Once joined, the others wait for it in
        # the state's sync, which has no timeout.
        hvd = _join_elastic_job(config)

    # The data's content hash, before and after reading it: the resume key and the MLflow run must name the
    # bytes the model was trained on, so files that change while they are read fail the run, not mislabel it.
    before = data_digest(config.data)
    train = load_split(config.dataset, config.data, "train", task=config.task, options=config.dataset_options)
    validation = load_split(config.dataset, config.data, "validation", task=config.task,
                            options=config.dataset_options)
    config = config.with_identity()
    if config.data_version != before:
        raise DataError(f"the files under --data {config.data} changed while the trainer read them ({before} "
                        f"before, {config.data_version} after); stage the data again and re-run")

    from nightshift.train.trainer import Trainer

    trainer_class: type[Trainer] = Trainer
    if config.elastic:
        from nightshift.train.elastic import ElasticTrainer

        trainer_class = ElasticTrainer
    else:
        hvd = _join_fixed_job()
    if on_epoch is None and config.search_trial is not None:
        from nightshift.search.reporter import TrialReporter

        on_epoch = TrialReporter.for_config(config)
    summary = trainer_class(config, train, validation, hvd, on_epoch=on_epoch).fit()
    if summary and config.mlflow_experiment:
        from nightshift.tracking import configure, log_training_run

        configure()  # rank 0 is this process's only MLflow user, and this its one use
        summary["mlflow_run_id"] = log_training_run(config.out, experiment=config.mlflow_experiment,
                                                    run_name=config.mlflow_run_name, tags=config.tags)
    return summary


def _join_fixed_job() -> Any:
    import horovod.torch as hvd

    hvd.init()
    return hvd


def _join_elastic_job(config: TrainConfig) -> Any:
    import horovod.torch as hvd

    from nightshift.train.elastic import horovod_has_join_patch, join, require_elastic_launcher, set_collective_timeout

    require_elastic_launcher()
    if not horovod_has_join_patch():
        logging.getLogger("nightshift.train").warning(
            "this Horovod is built without Nightshift's elastic-join patch (`nightshift doctor --build-horovod` "
            "builds and installs one with it): --join-timeout has no effect, and a process joining "
            "later than --collective-timeout terminates every rank, failing the job")
    set_collective_timeout(config.collective_timeout, config.join_timeout)
    join(hvd)
    return hvd


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nightshift.train", description="Horovod training entrypoint")
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging()
    try:
        run(config_from_args(args))
    except NightshiftError as err:
        print(f"nightshift.train: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


def add_parser(subparsers: Any) -> None:
    train = subparsers.add_parser("train", help="train in this process (under horovodrun: one worker)")
    add_arguments(train)
    train.set_defaults(func=_train_command)


def _train_command(args: argparse.Namespace) -> dict[str, Any]:
    configure_logging()
    try:
        return run(config_from_args(args))
    except ValueError as err:
        raise UsageError(str(err)) from err
