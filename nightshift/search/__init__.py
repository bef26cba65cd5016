"""Model search: Optuna studies whose trials are Nightshift training runs, pruned early (ASHA, Hyperband).

`space` parses and checks a search space; `study` holds the settings, storage, sampler, pruner and the
report; `reporter` is the trainer's per-epoch hook; `tracking` the MLflow parent and child runs; `best`
the best configuration under NIGHTSHIFT_HOME; `runner` a whole search in one process (`nightshift
search`). Nothing here imports Airflow; importing this package is cheap (optuna, torch and MLflow are
imported where they are used).
"""
