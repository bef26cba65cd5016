"""Model search benchmark (issue 11): ASHA against running every configuration to `max_epochs`.

`python -m bench search`. For each seed, both searches draw the same 18 configurations: the random
sampler is seeded per trial number, so trial k is the same configuration in each (checked). They run one
trial after another in this process (what `nightshift search` does), on the demo data, one torch thread.
For each: epochs spent (the compute), wall time, the best trial by validation accuracy and that model's
test accuracy, and the highest test accuracy of any completed trial. Then wall time of ASHA as one and
as two `nightshift search` processes started together on one study (max_concurrent_trials=2), with
heavier trials (64-channel-ish CNNs) so that process start-up does not dominate. Last, the cost of the
search's report page (`nightshift.search.report_html`, written when a search ends, so inside the wall
times above): rendering it again for seed 0's two studies, and its size.

Goal: ASHA spends at most a third of the full search's epochs, for a best test accuracy within 0.5
points of the full search's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nightshift.data.demo import write_demo_dataset

N_TRIALS = 18
MAX_EPOCHS = 9
MIN_EPOCHS = 1
REDUCTION_FACTOR = 3
SEEDS = (0, 1, 2)
SPACE = {
    "lr": {"type": "float", "low": 1e-3, "high": 0.3, "log": True},
    "momentum": {"type": "float", "low": 0.5, "high": 0.95},
    "batch_size": {"type": "categorical", "choices": [16, 64]},
    "model_kwargs.channels": {"type": "int", "low": 4, "high": 24},
}
FIXED = {"model_kwargs.hidden": 32, "threads": 1, "log_every": 100000}
# For wall time, trials long enough that process start-up (imports of torch, Horovod, MLflow) is small.
HEAVY_SPACE = {**SPACE, "model_kwargs.channels": {"type": "int", "low": 48, "high": 96}}
NIGHTSHIFT = str(Path(sys.executable).with_name("nightshift"))


def settings(data: Path, pruner: str, seed: int, space: dict[str, Any] = SPACE) -> Any:
    from nightshift.search.study import SearchSettings

    return SearchSettings(space=space, fixed=FIXED, data=str(data), max_epochs=MAX_EPOCHS, min_epochs=MIN_EPOCHS,
                          reduction_factor=REDUCTION_FACTOR, pruner=pruner, sampler="random", seed=seed)


def test_accuracy(out_dir: Path, data: Path) -> float:
    import torch

    from nightshift.datasets import load_split
    from nightshift.train.artifacts import load_trained_model

    split = load_split("digits", data, "test")
    with torch.no_grad():
        predicted = load_trained_model(out_dir)(split.features).argmax(dim=1)
    return float((predicted == split.labels).float().mean())


def outcome(report: dict[str, Any], home: Path, data: Path, seconds: float) -> dict[str, Any]:
    from nightshift.search.runner import trial_dir

    os.environ["NIGHTSHIFT_HOME"] = str(home)
    complete = [t for t in report["trials"] if t["state"] == "COMPLETE"]
    tests = {t["number"]: test_accuracy(trial_dir(report["study"], t["number"]) / "out", data) for t in complete}
    best = report["best"]["trial"]
    return {"epochs": report["epochs_spent"], "seconds": seconds, "trials": len(report["trials"]),
            "states": {s: sum(t["state"] == s for t in report["trials"]) for s in ("COMPLETE", "PRUNED", "FAIL")},
            "best_trial": best, "best_val": report["best"]["value"], "best_test": tests[best],
            "max_test": max(tests.values()), "params": {t["number"]: t["params"] for t in report["trials"]}}


def sequential(pruner: str, seed: int, data: Path, root: Path) -> dict[str, Any]:
    from nightshift.search.runner import SearchRequest, run_search

    home = root / f"{pruner}-{seed}"
    os.environ["NIGHTSHIFT_HOME"] = str(home)
    started = time.perf_counter()
    report = run_search(SearchRequest(settings=settings(data, pruner, seed), trials=N_TRIALS,
                                      study=f"bench-{pruner}"))
    return outcome(report, home, data, time.perf_counter() - started)


def processes(count: int, data: Path, root: Path) -> dict[str, Any]:
    """ASHA on HEAVY_SPACE as `count` `nightshift search` processes started together on one study (at most
    `count` trials at once). The study, MLflow store and parent run are made first, outside the timing."""
    from nightshift.search.runner import open_search

    home = root / f"asha-x{count}"
    home.mkdir(parents=True)
    storage = f"sqlite:///{home / 'search' / 'optuna.db'}"
    os.environ["NIGHTSHIFT_HOME"] = str(home)
    open_search(settings(data, "asha", SEEDS[0], HEAVY_SPACE), storage=storage, study="bench-asha")
    env = {**os.environ, "NIGHTSHIFT_HOME": str(home)}
    command = [NIGHTSHIFT, "search", "--data", str(data), "--space", json.dumps(HEAVY_SPACE), "--fixed",
               json.dumps(FIXED), "--trials", str(N_TRIALS), "--max-epochs", str(MAX_EPOCHS), "--min-epochs",
               str(MIN_EPOCHS), "--reduction-factor", str(REDUCTION_FACTOR), "--sampler", "random", "--seed",
               str(SEEDS[0]), "--study", "bench-asha", "--storage", storage]
    with (home / "searches.log").open("w") as log:
        started = time.perf_counter()
        running = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
                   for _ in range(count)]
        outputs = [p.communicate(timeout=3600)[0] for p in running]
        seconds = time.perf_counter() - started
    if any(p.returncode for p in running):
        tail = "\n".join((home / "searches.log").read_text().splitlines()[-20:])
        raise RuntimeError(f"a search failed: exits {[p.returncode for p in running]}:\n{tail}")
    report = max((json.loads(o) for o in outputs), key=lambda r: len(r["trials"]))
    return outcome(report, home, data, seconds)


def report_cost(home: Path, study: str, repeats: int = 3) -> dict[str, float]:
    """Seconds to render and write the report page of `study` in `home` again (min and median of `repeats`)
    and the page's size."""
    from nightshift.search.report_html import write_report
    from nightshift.search.study import load_study

    os.environ["NIGHTSHIFT_HOME"] = str(home)
    loaded, config = load_study(f"sqlite:///{home / 'search' / 'optuna.db'}", study)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        path = write_report(loaded, config)
        times.append(time.perf_counter() - started)
    return {"min": min(times), "median": statistics.median(times), "megabytes": path.stat().st_size / 1e6}


def main() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        root = Path(tmp)
        data = root / "data"
        write_demo_dataset(data, seed=0)
        load = os.getloadavg()[0]
        for seed in SEEDS:
            full = sequential("none", seed, data, root)
            asha = sequential("asha", seed, data, root)
            if asha["params"] != full["params"]:
                raise RuntimeError(f"seed {seed}: the two searches drew different configurations")
            rows.append((seed, full, asha))
        one, two = processes(1, data, root), processes(2, data, root)
        pages = {pruner: report_cost(root / f"{pruner}-{SEEDS[0]}", f"bench-{pruner}") for pruner in ("none", "asha")}
        load_after = os.getloadavg()[0]
    print(f"{N_TRIALS} configurations per seed (random sampler), max_epochs {MAX_EPOCHS}, ASHA rungs at "
          f"{MIN_EPOCHS} x {REDUCTION_FACTOR}^k epochs; load average {load:.1f} -> {load_after:.1f}")
    print("| seed | search | epochs spent | wall s | COMPLETE / PRUNED | best trial (val acc) | its test acc | "
          "best test acc of any completed trial |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, full, asha in rows:
        for name, row in (("every configuration to max_epochs", full), ("ASHA", asha)):
            print(f"| {seed} | {name} | {row['epochs']} | {row['seconds']:.0f} | {row['states']['COMPLETE']} / "
                  f"{row['states']['PRUNED']} | {row['best_trial']} ({row['best_val']:.4f}) | "
                  f"{row['best_test']:.4f} | {row['max_test']:.4f} |")
    for seed, full, asha in rows:
        ratio = asha["epochs"] / full["epochs"]
        gap = (full["best_test"] - asha["best_test"]) * 100
        print(f"seed {seed}: ASHA compute / full {ratio:.3f} (goal <= 0.333: {'met' if ratio <= 1 / 3 else 'missed'});"
              f" best test accuracy {gap:+.2f} points below full (goal <= 0.5: {'met' if gap <= 0.5 else 'missed'})")
    print(f"seed {SEEDS[0]}, channels 48-96, ASHA as `nightshift search` processes on one study: 1 process "
          f"{one['seconds']:.0f} s "
          f"({one['epochs']} epochs), 2 processes (max_concurrent_trials=2) {two['seconds']:.0f} s "
          f"({two['epochs']} epochs, {two['states']['PRUNED']} pruned, best test {two['best_test']:.4f}); "
          f"ratio {two['seconds'] / one['seconds']:.2f}")
    for pruner, page in pages.items():
        print(f"report page of seed {SEEDS[0]}'s {'ASHA' if pruner == 'asha' else 'full'} study ({N_TRIALS} trials): "
              f"{page['min']:.2f} s (median {page['median']:.2f} s of 3), {page['megabytes']:.2f} MB")
    print(json.dumps({"seeds": {seed: {"full": full, "asha": asha} for seed, full, asha in rows},
                      "processes": {"1": one, "2": two}, "report_pages": pages}, default=str, sort_keys=True))


if __name__ == "__main__":
    main()
