"""`evaluate` on heavy-tailed data (issue 34 item 3): nights out of 1,000 that complete without error.

Method: the generated heavy-tailed table of `bench_suite` (three lognormal columns, sigma 1 to 1.5, one normal,
a binary target) is written as train/validation/test splits (600 rows, seed 0); two small MLPs are trained on it
once (tests/tabular_data.py `train`, logged to MLflow in a temporary NIGHTSHIFT_HOME) and one is crowned
@champion. Each night replaces test.parquet with a fresh sample of the same distribution (120 rows, seed = the
night), and `nightshift.evaluate.evaluate` runs end to end (both models loaded and scored through their pyfunc,
the gate, MLflow logging, artifacts). A night completes when evaluate returns; any exception is counted by its
type and message.

Also reported: the drift figure evaluate reports (`challenger.drift.rows`, the share of test rows with a value
outside the train split's range) over the nights, and the nights on which the serving range guard that
evaluation used before the fix (any value beyond the train range widened by RANGE_MARGIN ranges: refused) would
have refused the split for the challenger or the champion: what failed before.

Run: `python -m bench evaluate` (NIGHTSHIFT_BENCH_EVALUATE_NIGHTS, default 1000; ..._FIRST_NIGHT, default 0: the
models are trained the same way every run, so runs of consecutive nights add up).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

TEST_ROWS = 120


def beyond_guard(model: Any, frame: Any) -> bool:
    """Whether any value of `frame` lies beyond the model's learned serving bounds (what refused before)."""
    from nightshift.evaluate import _classifier

    spec = _classifier(model).features
    values = frame[list(spec.columns)].to_numpy(dtype=np.float64)
    return bool(((values < np.asarray(spec.low)) | (values > np.asarray(spec.high))).any())


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-evaluate-") as tmp:
        os.environ["NIGHTSHIFT_HOME"] = tmp
        run(Path(tmp))


def run(home: Path) -> None:
    import mlflow.pyfunc

    from bench.bench_suite import LABEL, heavy_tailed
    from nightshift import tracking
    from nightshift.evaluate import evaluate
    from tests.tabular_data import crown, train, write_splits

    nights = int(os.environ.get("NIGHTSHIFT_BENCH_EVALUATE_NIGHTS", "1000"))
    first = int(os.environ.get("NIGHTSHIFT_BENCH_EVALUATE_FIRST_NIGHT", "0"))
    data = write_splits(heavy_tailed(600, seed=0), home / "data")
    tracking.configure()
    champion = train(data, home / "champion", task="binary", label=LABEL, seed=0)
    crown(champion, "heavy")
    challenger = train(data, home / "challenger", task="binary", label=LABEL, seed=1)
    models = [mlflow.pyfunc.load_model(tracking.run_model_uri(run)) for run in (challenger, champion)]
    gate = {"task": "binary", "primary": "accuracy", "floor": 0.5}

    completed, errors, guarded = 0, Counter[str](), 0
    drift: list[float] = []
    seconds: list[float] = []
    for night in range(first, first + nights):
        test = heavy_tailed(TEST_ROWS, seed=10_000 + night)
        test.to_parquet(data / "test.parquet")
        guarded += any(beyond_guard(model, test) for model in models)
        started = time.perf_counter()
        try:
            result = evaluate(challenger, data_dir=data, model_name="heavy", label_column=LABEL, gate=gate)
        except Exception as err:
            errors[f"{type(err).__name__}: {str(err)[:160]}"] += 1
            continue
        finally:
            seconds.append(time.perf_counter() - started)
        completed += 1
        drift.append(float((result["challenger"].get("drift") or {}).get("rows", 0.0)))
        if (night + 1 - first) % 100 == 0:
            print(json.dumps({"nights": night + 1 - first, "completed": completed, "errors": sum(errors.values())}),
                  flush=True)
    shares = np.asarray(drift) if drift else np.zeros(1)
    print(json.dumps({
        "nights": nights, "first_night": first, "completed": completed, "errors": dict(errors.most_common(5)),
        "nights_the_old_range_guard_refused": guarded,
        "seconds_per_night": round(float(np.mean(seconds)), 3),
        "drift_rows_outside_train_range": {
            "nights_with_any": round(float((shares > 0).mean()), 4), "mean": round(float(shares.mean()), 4),
            "median": round(float(np.median(shares)), 4), "p90": round(float(np.quantile(shares, 0.9)), 4),
            "p99": round(float(np.quantile(shares, 0.99)), 4), "max": round(float(shares.max()), 4)},
        "drift_per_night": [round(v, 4) for v in drift],
    }), flush=True)


if __name__ == "__main__":
    main()
