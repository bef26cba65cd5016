"""Where a test run's CPU goes: samples /proc once a second while a command (e.g. `make test`) runs and charges
each process's CPU time (user + system, at its last sample) to the test and the test module that started it
(the PYTEST_CURRENT_TEST it inherited) and to a kind of process (Airflow's scheduler, a trainer, redis-server...).

    python -m bench.suite_cpu OUT.json -- make test PYTEST_ARGS=...

Processes that live less than a second may be missed; the totals are a lower bound. Linux only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
KINDS = (  # first match of a substring of the command line
    ("airflow scheduler", "airflow-scheduler"), ("airflow dag-processor", "airflow-dag-processor"),
    ("airflow triggerer", "airflow-triggerer"), ("airflow api-server", "airflow-api-server"),
    ("uvicorn", "airflow-api-server"), ("airflow standalone", "airflow-standalone"),
    ("airflow dags test", "airflow-dags-test"), ("airflow celery", "airflow-celery"),
    ("airflow tasks", "airflow-task"), ("task-sdk", "airflow-task"), ("supervisor", "airflow-task"),
    ("horovodrun", "horovodrun"), ("nightshift.train", "trainer"), ("nightshift train", "trainer"),
    ("redis-server", "redis-server"), ("sshd", "sshd"), ("mlflow", "mlflow"), ("postgres", "postgres"),
    ("chrom", "chromium"), ("dvc", "dvc"), ("xdist", "pytest-worker"), ("pytest", "pytest"),
    ("airflow", "airflow-other"), ("python", "python-other"),
)


def kind_of(cmdline: str) -> str:
    for needle, kind in KINDS:
        if needle in cmdline:
            return kind
    return cmdline.split(" ", 1)[0].rsplit("/", 1)[-1] or "?"


def test_of(environ: bytes) -> str:
    """The test (module::name[params]) whose PYTEST_CURRENT_TEST a process inherited, without the phase."""
    for entry in environ.split(b"\0"):
        if entry.startswith(b"PYTEST_CURRENT_TEST="):
            return entry.split(b"=", 1)[1].decode(errors="replace").rsplit(" (", 1)[0]
    return "-"


def sample(seen: dict[int, dict[str, object]]) -> None:
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        pid = int(pid_dir.name)
        try:
            stat = (pid_dir / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICK
            start = int(fields[19])
            key = pid * 10**12 + start  # a reused pid is another process
            if key not in seen:
                cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                test = test_of((pid_dir / "environ").read_bytes())
                seen[key] = {"cmd": cmd[:300], "kind": kind_of(cmd), "test": test,
                             "module": test.split("::", 1)[0]}
            seen[key]["cpu"] = cpu
        except (OSError, ValueError, IndexError):
            continue


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    seen: dict[int, dict[str, object]] = {}
    before = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    started = time.monotonic()
    proc = subprocess.Popen(argv[2:])
    while proc.poll() is None:
        sample(seen)
        time.sleep(1.0)
    wall = time.monotonic() - started
    rows = [v for k, v in seen.items() if k // 10**12 not in before]
    by_module: dict[str, float] = defaultdict(float)
    by_kind: dict[str, float] = defaultdict(float)
    by_both: dict[str, float] = defaultdict(float)
    by_test: dict[str, float] = defaultdict(float)
    for row in rows:
        by_test[str(row["test"])] += float(row["cpu"])  # type: ignore[arg-type]
        by_module[str(row["module"])] += float(row["cpu"])  # type: ignore[arg-type]
        by_kind[str(row["kind"])] += float(row["cpu"])  # type: ignore[arg-type]
        by_both[f"{row['module']} | {row['kind']}"] += float(row["cpu"])  # type: ignore[arg-type]

    def ranked(d: dict[str, float]) -> list[tuple[str, float]]:
        return sorted(((k, round(v, 1)) for k, v in d.items()), key=lambda kv: -kv[1])

    report: dict[str, Any] = {"wall_s": round(wall, 1), "rc": proc.returncode, "cpu_s": round(sum(by_kind.values()), 1),
              "by_module": ranked(by_module), "by_kind": ranked(by_kind), "by_module_kind": ranked(by_both)[:80],
              "by_test": ranked(by_test)[:80]}
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("wall_s", "rc", "cpu_s")}))
    for name, cpu in report["by_kind"][:15]:
        print(f"{cpu:9.1f} s  {name}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
