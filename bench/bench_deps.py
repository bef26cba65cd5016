"""Dependency sets side by side (issue 37): the trainer and DAG-parse benchmarks in two interpreters, an old and a
new set, alternately (old, new, old, new, ...), and the medians of each with new/old, so that a regression from an
upgrade is seen.

    python -m bench deps --old /tmp/old/bin/python --new /tmp/new/bin/python [--repeats 3] [--parse-repeats 5]

Each interpreter runs its own checkout: the tree its `nightshift` is imported from (an editable install, as `make`
sets up), so bench/, dags/ and nightshift/ are that set's. One run is one child process: the trainer benchmark's
three configurations once each (bench_trainer.trainer_run, plain_run), or bench_dag.bench_parse (the median of
--parse-repeats interleaved parses of the DAG file and of an empty one). Without --old/--new (`python -m bench`
runs every benchmark) it says so and does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCHES = ("trainer", "parse")
PACKAGES = ("apache-airflow", "apache-airflow-task-sdk", "structlog", "mlflow", "torch", "great-expectations",
            "airflow-provider-great-expectations", "horovod")

CHILD = r"""
import json, sys, tempfile
from pathlib import Path
from bench import bench_dag, bench_trainer
from nightshift.data.demo import write_demo_dataset
with tempfile.TemporaryDirectory() as name:
    tmp = Path(name)
    if sys.argv[1] == "trainer":
        data = tmp / "data"
        write_demo_dataset(data, rows=1797, seed=0)
        one, two = (bench_trainer.trainer_run(data, Path(tempfile.mkdtemp(dir=tmp)), n) for n in (1, 2))
        plain = bench_trainer.plain_run(data, Path(tempfile.mkdtemp(dir=tmp)))
        out = {"trainer 1 worker, loop (s)": one["loop"], "trainer 1 worker, end to end (s)": one["wall"],
               "trainer 2 workers, end to end (s)": two["wall"], "plain loop, loop (s)": plain["loop"],
               "trainer / plain loop (loop)": one["loop"] / plain["loop"],
               "scaling efficiency 2 vs 1 (end to end)": one["wall"] / (2 * two["wall"])}
    else:
        parse = bench_dag.bench_parse(tmp)
        out = {"DAG file parse (s)": parse["dag_s"], "empty DAG parse (s)": parse["empty_s"],
               "DAG / empty parse": parse["ratio"]}
print(json.dumps(out))
"""

VERSIONS = r"""
import json, pathlib, sys
from importlib import metadata
import nightshift
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print(json.dumps({"src": str(pathlib.Path(nightshift.__file__).resolve().parents[1]),
                  "versions": {name: version(name) for name in sys.argv[1:]}}))
"""


def parse_args(argv: list[str]) -> argparse.Namespace | None:
    """The options after the benchmark names (`deps --old A --new B`); None when none of them is this benchmark's
    (`python -m bench` runs every benchmark, and the options may be another one's)."""
    first_option = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    if not any(a.split("=")[0] in ("--old", "--new", "-h", "--help") for a in argv[first_option:]):
        return None
    parser = argparse.ArgumentParser(prog="python -m bench deps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the old set's Python (its venv's bin/python)")
    parser.add_argument("--new", required=True, help="the new set's Python")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each benchmark in each set (default 3)")
    parser.add_argument("--parse-repeats", type=int, default=5, help="parses of each DAG file a run (default 5)")
    args = parser.parse_args(argv[first_option:])
    if args.repeats < 1 or args.parse_repeats < 1:
        parser.error("--repeats and --parse-repeats must be at least 1")
    return args


def schedule(repeats: int) -> list[tuple[int, str, str]]:
    """(repeat, benchmark, set) in run order: each benchmark old, new, old, new, ... within each repeat."""
    return [(r, bench, which) for r in range(1, repeats + 1) for bench in BENCHES for which in ("old", "new")]


def table(runs: dict[str, list[dict[str, float]]]) -> str:
    """A Markdown table of each measure's median in the old and the new set, new/old of the medians, new/old of
    each repeat's pair of runs (the n-th old run with the n-th new one, next to each other in time: median, min-max)
    and the runs counted."""
    names = list(dict.fromkeys(name for which in ("old", "new") for run in runs.get(which, []) for name in run))
    lines = ["| measure | old (median) | new (median) | new / old | new / old per repeat (min-max) | runs (old, new) |",
             "|---|---|---|---|---|---|"]
    for name in names:
        values = {which: [run[name] for run in runs.get(which, []) if name in run] for which in ("old", "new")}
        med = {which: statistics.median(v) if v else None for which, v in values.items()}
        old, new = med["old"], med["new"]
        ratio = f"{new / old:.3f}" if old and new is not None else "—"
        pairs = [b[name] / a[name] for a, b in zip(runs.get("old", []), runs.get("new", []), strict=False)
                 if a.get(name) and name in b]
        paired = f"{statistics.median(pairs):.3f} ({min(pairs):.3f}-{max(pairs):.3f})" if pairs else "—"
        cells = [f"{m:.3f}" if m is not None else "—" for m in (old, new)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {ratio} | {paired} | "
                     f"{len(values['old'])}, {len(values['new'])} |")
    return "\n".join(lines)


def describe(python: str) -> dict[str, object]:
    """Where `python`'s nightshift comes from (from /, so not this checkout through the working directory) and the
    versions of PACKAGES in it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", VERSIONS, *PACKAGES], capture_output=True, text=True, check=True, cwd="/",
                         env=env).stdout
    info: dict[str, object] = json.loads(out)
    if not (Path(str(info["src"])) / "bench" / "bench_trainer.py").is_file():
        raise SystemExit(f"{python}: nightshift is imported from {info['src']}, not a checkout with bench/ "
                         "(install the project editable: pip install -e)")
    return info


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args is None:
        print("deps: skipped (needs --old PYTHON --new PYTHON: python -m bench deps --help)")
        return 0
    pythons = {"old": args.old, "new": args.new}
    info = {which: describe(python) for which, python in pythons.items()}
    for which, python in pythons.items():
        print(f"{which}: {python}, checkout {info[which]['src']}, {json.dumps(info[which]['versions'])}")
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    loads = [os.getloadavg()[0]]
    for repeat, bench, which in schedule(args.repeats):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["NIGHTSHIFT_BENCH_PARSE_REPEATS"] = str(args.parse_repeats)
        before = os.getloadavg()[0]
        proc = subprocess.run([pythons[which], "-c", CHILD, bench], cwd=str(info[which]["src"]), env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"repeat {repeat}: {bench} in the {which} set exited {proc.returncode}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        runs[which].append(result)
        loads.append(os.getloadavg()[0])
        print(f"  repeat {repeat}: {bench:7s} {which}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items())
              + f"  (load {before:.1f} before)", flush=True)
    print(f"load (1 min) over the runs: median {statistics.median(loads):.1f}, min {min(loads):.1f}, "
          f"max {max(loads):.1f} on {os.cpu_count()} cores")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
