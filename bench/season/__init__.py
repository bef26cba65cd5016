"""A season unattended (issue 36): nights of changing data through the real scheduler, with faults, judged by an
oracle that is independent of the pipeline's gate.

- `script`: the season script (each night's data event and fault) and the data generator that writes each night's
  version, and the golden held-out table the oracle scores every champion on;
- `oracle`: what each night should have ended in, and the checks of the season (independent of the gate);
- `airflow`: Airflow's components on PostgreSQL (a private instance when the binaries exist), kept running as a
  supervisor would, and the REST API;
- `faults`: the faults a night may suffer;
- `runner`: the season itself, night by night, and its table.

`python -m bench season --nights N` (bench/bench_season.py) runs one (the short-season integration test is in
history, ff0fd8c^, until it fits CI's budget).
"""
