"""`make demo`: the demo data, then `airflow dags test nightly_retrain` twice, with a summary of each run.

State goes to NIGHTSHIFT_HOME (default ~/.nightshift); Airflow's own home (SQLite metadata DB, logs) to
NIGHTSHIFT_HOME/airflow-home unless AIRFLOW_HOME is set. The DAGs and plugins come from this repository.
Run 1 trains with the local backend (2 Horovod workers) and deploys; run 2 forces a retrain on the same
data and shows the gate refusing to promote a model that is not better. The model server keeps running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DAG_ID = "nightly_retrain"
GPU_POOL_SLOTS = 16


def nightshift_home() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_HOME", Path.home() / ".nightshift")).expanduser()


def airflow_env(nightshift: Path, airflow_home: Path | None = None) -> dict[str, str]:
    """The environment every Airflow command of this project runs in: SQLite, repo dags/plugins, no examples."""
    airflow_home = airflow_home or Path(os.environ.get("AIRFLOW_HOME") or nightshift / "airflow-home")
    env = dict(os.environ)
    env.update({
        "NIGHTSHIFT_HOME": str(nightshift),
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(airflow_home / "logs"),
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
        "GX_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    })
    return env


def airflow(env: dict[str, str], *args: str, check: bool = True, capture: bool = True,
            timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(BIN / "airflow"), *args], env=env, text=True, timeout=timeout,
                          capture_output=capture, check=False)
    if check and proc.returncode != 0:
        tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-40:])
        raise RuntimeError(f"airflow {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc


def prepare_airflow(env: dict[str, str]) -> None:
    """Migrate the metadata DB and create the `gpu` pool the Horovod operator takes slots from."""
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    airflow(env, "db", "migrate")
    airflow(env, "pools", "set", "gpu", str(GPU_POOL_SLOTS), "Horovod training slots (GPUs, or CPU jobs)")


def ledger(nightshift: Path) -> list[dict[str, Any]]:
    path = nightshift / "airflow" / DAG_ID / "runs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_dag(env: dict[str, str], conf: dict[str, Any], *, stream: bool = True,
            timeout: float | None = 3600) -> tuple[int, dict[str, Any] | None, float]:
    """`airflow dags test nightly_retrain -c CONF`: (exit code, the run's ledger record, seconds)."""
    nightshift = Path(env["NIGHTSHIFT_HOME"])
    before = len(ledger(nightshift))
    start = time.monotonic()
    proc = airflow(env, "dags", "test", DAG_ID, "-c", json.dumps(conf), check=False, capture=not stream,
                   timeout=timeout)
    seconds = time.monotonic() - start
    records = ledger(nightshift)[before:]
    return proc.returncode, (records[-1] if records else None), seconds


def predict(url: str, data_dir: Path, rows: int = 5) -> tuple[list[int], list[int]]:
    """Ask the model server for `rows` test rows: (predicted, true labels)."""
    import pandas as pd
    import requests

    frame = pd.read_parquet(data_dir / "test.parquet").head(rows)
    labels = frame.pop("label").astype(int).tolist()
    body = {"dataframe_split": {"columns": list(frame.columns), "data": frame.to_numpy().tolist()}}
    answer = requests.post(f"{url}/invocations", json=body, timeout=30)
    answer.raise_for_status()
    predictions = answer.json()["predictions"]
    return [int(p["predicted_label"]) for p in predictions], labels


def print_summary(title: str, record: dict[str, Any] | None, seconds: float) -> None:
    print(f"\n=== {title} ({seconds:.0f}s)")
    if record is None:
        print("  no run record: the run did not reach its report (see the log above)")
        return
    print(f"  status          : {record.get('status')} - {record.get('outcome')}")
    if record.get("status") != "success":
        print(f"  failed task     : {record.get('failed_task')}: {record.get('reason')}")
        return
    print(f"  dataset version : {record.get('dataset_version')} ({record.get('dataset_rows')} rows)")
    metrics = record.get("train_metrics") or {}
    if metrics:
        shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, (int, float))}
        print(f"  train metrics   : {json.dumps(shown)}")
    gate = record.get("gate")
    if gate:
        print(f"  gate decision   : {'PROMOTE' if gate['passed'] else 'DO NOT PROMOTE'}")
        for reason in gate["reasons"]:
            print(f"                    {reason}")
    print(f"  model version   : {record.get('model_version') or '(none registered)'}")
    print(f"  serving URL     : {record.get('serving_url') or '(unchanged)'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quiet", action="store_true", help="do not stream the Airflow logs")
    args = parser.parse_args(argv)

    nightshift = nightshift_home()
    env = airflow_env(nightshift)
    os.environ["NIGHTSHIFT_HOME"] = str(nightshift)
    print(f"NIGHTSHIFT_HOME={nightshift}\nAIRFLOW_HOME={env['AIRFLOW_HOME']}", flush=True)
    data = nightshift / "demo-data" / "digits"
    subprocess.run([str(BIN / "nightshift"), "demo-data", str(data)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    print(f"demo data: {data}", flush=True)
    prepare_airflow(env)

    base = {"data_source": str(data), "epochs": args.epochs, "workers": args.workers, "backend": "local"}
    code, first, seconds = run_dag(env, base, stream=not args.quiet)
    print_summary("run 1: nightly_retrain on the demo data", first, seconds)
    if code != 0 or not first or first.get("status") != "success":
        print(f"run 1 failed (airflow dags test exited {code})", file=sys.stderr)
        return 1

    from nightshift.deploy.local import read_record

    serving = read_record("nightshift-digits")
    if serving:
        try:
            predicted, labels = predict(serving["url"], data)
            print(f"  prediction      : POST {serving['url']}/invocations -> {predicted} (true {labels})")
        except Exception as err:  # a record left by an earlier demo whose server is gone
            print(f"  prediction      : {serving['url']} does not answer ({err}); run "
                  f"`nightshift deploy --stop` and `make demo` again")
    else:
        print("  prediction      : nothing is serving (no model passed the gate yet)")

    code, second, seconds = run_dag(env, {**base, "force": True}, stream=not args.quiet)
    print_summary("run 2: same data, force=true (retrain; the gate decides)", second, seconds)
    if code != 0 or not second or second.get("status") != "success":
        print(f"run 2 failed (airflow dags test exited {code})", file=sys.stderr)
        return 1
    if second.get("serving_url"):
        print("  !! run 2 promoted a new model", file=sys.stderr)
    else:
        print("  run 2 did not promote: the new model is not better than the champion, which keeps serving.")
    print("  (Without force=true an unchanged dataset and code skip training altogether.)")

    serving = read_record("nightshift-digits")
    if serving:
        print(f"\nThe champion v{serving['version']} keeps serving at {serving['url']} (pid {serving['pid']}).")
        print(f"Stop it with: NIGHTSHIFT_HOME={nightshift} {BIN / 'nightshift'} deploy --stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
