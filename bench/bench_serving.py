"""Model server overhead: the local MLflow model server vs the same pyfunc model called in-process.

Single-row latency (p50, p99) and batch-256 throughput, measured side by side on one trained demo model
(`python -m bench serving`). The server is started through `deploy_local`, as the DAG does, and stopped
at the end.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SINGLE_CALLS = 300
BATCH_CALLS = 40
BATCH = 256


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _interleaved(calls: dict[str, Callable[[], Any]], n: int) -> dict[str, list[float]]:
    """Time each call n times, alternating between them so load changes on a shared machine hit all alike."""
    for call in calls.values():
        for _ in range(5):
            call()
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            out[name].append(time.perf_counter() - start)
    return out


def measure(model_uri: str, url: str, frame: Any) -> dict[str, dict[str, float]]:
    import mlflow.pyfunc
    import requests
    import torch

    model = mlflow.pyfunc.load_model(model_uri)
    torch_model = model.unwrap_python_model().classifier.model
    session = requests.Session()
    one, batch = frame.head(1), frame.sample(BATCH, replace=True, random_state=0).reset_index(drop=True)

    def served(f: Any) -> Callable[[], None]:
        body = {"dataframe_split": {"columns": list(f.columns), "data": f.to_numpy().tolist()}}

        def call() -> None:
            session.post(f"{url}/invocations", json=body, timeout=30).raise_for_status()

        return call

    def forward(f: Any) -> Callable[[], None]:
        tensor = torch.from_numpy(f.to_numpy("float32") / 16.0)

        def call() -> None:
            with torch.inference_mode():
                torch_model(tensor)

        return call

    single = _interleaved({"torch_forward": forward(one), "in_process": lambda: model.predict(one),
                           "server": served(one)}, SINGLE_CALLS)
    batched = _interleaved({"torch_forward": forward(batch), "in_process": lambda: model.predict(batch),
                            "server": served(batch)}, BATCH_CALLS)
    return {name: {"p50_ms": 1000 * _percentile(single[name], 50), "p99_ms": 1000 * _percentile(single[name], 99),
                   "batch256_rows_per_s": BATCH / statistics.median(batched[name])} for name in single}


def main() -> None:
    import pandas as pd

    from nightshift.data.demo import write_demo_dataset
    from nightshift.deploy.local import deploy_local, stop_local
    from nightshift.registry import register
    from nightshift.tracking import log_training_run, run_model_uri
    from tests.trained_model import write_trained_output

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        os.environ["NIGHTSHIFT_HOME"] = str(Path(tmp) / "home")
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        data = Path(tmp) / "data"
        write_demo_dataset(data)
        out = write_trained_output(Path(tmp) / "out", data, epochs=3)
        run_id = log_training_run(out, experiment="bench")
        register(run_id, model_name="bench-digits")
        started = time.perf_counter()
        deployed = deploy_local("bench-digits", data_dir=data)
        startup = time.perf_counter() - started
        try:
            frame = pd.read_parquet(data / "test.parquet").drop(columns=["label"])
            results = measure(run_model_uri(run_id), deployed["url"], frame)
        finally:
            stop_local("bench-digits")
    inp, srv = results["in_process"], results["server"]
    print(f"deploy_local (download, start, health, canary): {startup:.1f} s")
    print("in_process = the same MLflow pyfunc loaded in this process; torch_forward = the bare network")
    print(f"{'':14} {'p50 ms':>8} {'p99 ms':>8} {'batch-256 rows/s':>18}")
    for name, r in results.items():
        print(f"{name:14} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['batch256_rows_per_s']:18.0f}")
    print(f"overhead ratio (server / in-process): p50 x{srv['p50_ms'] / inp['p50_ms']:.1f}, "
          f"p99 x{srv['p99_ms'] / inp['p99_ms']:.1f}, "
          f"batch-256 throughput x{inp['batch256_rows_per_s'] / srv['batch256_rows_per_s']:.1f} lower")


if __name__ == "__main__":
    main()
