"""`nightshift search`: an Optuna model search with early stopping (ASHA or Hyperband), without Airflow."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nightshift.search.study import PRUNERS, SAMPLERS


def add_parser(subparsers: Any) -> None:
    search = subparsers.add_parser(
        "search", help="search trainer options with Optuna, stopping bad trials early; prints the study as JSON",
        description="Trials run one after another with the real trainer in this process; each reports "
                    "val_accuracy (val_rmse for a regression) after every epoch and is pruned at the pruner's "
                    "rungs. The study lives in NIGHTSHIFT_HOME/search/optuna.db unless --storage; the best "
                    "configuration goes to NIGHTSHIFT_HOME/search/<pipeline>/best.json, which that pipeline's "
                    "training reads.")
    search.add_argument("--data", required=True, help="dataset directory (train/validation/test.parquet)")
    search.add_argument("--pipeline", default=None, metavar="DECLARATION",
                        help="the pipeline declaration (YAML) to search for: every trial trains its dataset loader, "
                             "task and model, the objective is its task's, and the result is its best.json "
                             "(default: nightly_retrain, the demo digits, with the trainer's defaults)")
    search.add_argument("--space", required=True,
                        help='search space: a JSON object (or @FILE), e.g. {"lr": {"type": "float", "low": 1e-3, '
                             '"high": 0.3, "log": true}, "batch_size": {"type": "categorical", "choices": [16, 64]}}')
    search.add_argument("--fixed", default="{}",
                        help='trainer options every trial shares, JSON (or @FILE), e.g. {"model_kwargs.hidden": 32}')
    search.add_argument("--trials", type=int, required=True, help="trials the study holds when the search ends")
    search.add_argument("--max-epochs", type=int, required=True, help="epochs of a trial that is never pruned")
    search.add_argument("--min-epochs", type=int, default=1, help="epochs before the first rung (1)")
    search.add_argument("--reduction-factor", type=int, default=3, help="1/F of the trials go on at each rung (3)")
    search.add_argument("--pruner", choices=PRUNERS, default="asha",
                        help="asha: asynchronous successive halving; hyperband; none: no early stopping (asha)")
    search.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="(tpe)")
    search.add_argument("--startup-trials", type=int, default=10, help="TPE: random trials before modelling (10)")
    search.add_argument("--seed", type=int, default=0, help="sampler seed (0)")
    search.add_argument("--storage", default=None,
                        help="Optuna storage URL, e.g. postgresql://user@host:5432/db (default: SQLite under "
                             "NIGHTSHIFT_HOME); no password in it")
    search.add_argument("--study", default=None,
                        help="study name (default: a hash of the settings, so the same search continues)")
    search.add_argument("--experiment", default=None, help="MLflow experiment of the runs (nightshift-search)")
    search.add_argument("--budget-hours", type=float, default=None,
                        help="compute budget in CPU- (GPU-) hours: past it no new trial starts")
    search.set_defaults(func=_search)


def _search(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.search import tracking
    from nightshift.search.pipeline import DEFAULT_PIPELINE, declared_training, fixed_options
    from nightshift.search.runner import SearchRequest, run_search
    from nightshift.search.space import load_json_object
    from nightshift.search.study import SearchSettings
    from nightshift.train.cli import configure_logging

    configure_logging()
    space, fixed = load_json_object(args.space, "search space"), load_json_object(args.fixed, "fixed options")
    pipeline, declared = DEFAULT_PIPELINE, None
    if args.pipeline:
        from nightshift.pipelines import load_pipeline

        loaded = load_pipeline(args.pipeline)
        fixed, pipeline, declared = fixed_options(loaded, space, fixed), loaded.dag_id, declared_training(loaded)
    settings = SearchSettings(
        space=space, fixed=fixed, data=str(Path(args.data).expanduser().resolve()), max_epochs=args.max_epochs,
        min_epochs=args.min_epochs, reduction_factor=args.reduction_factor, pruner=args.pruner, sampler=args.sampler,
        seed=args.seed, startup_trials=args.startup_trials, pipeline=pipeline, declared=declared)
    request = SearchRequest(settings=settings, trials=args.trials, storage=args.storage, study=args.study,
                            experiment=args.experiment or tracking.EXPERIMENT, budget_hours=args.budget_hours)
    return run_search(request)
