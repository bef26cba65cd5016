"""Trainer benchmarks (issues 2 and 13): three configurations, interleaved, repeated, medians and spreads.

1. Trainer overhead: `python -m nightshift.train` (1 process, default checkpoint cadence) against a
   minimal plain-PyTorch loop on the same model, data, batch and steps.
2. Data-parallel scaling: 2 Horovod workers vs 1 at the same global batch → efficiency
   = time with 1 worker / (2 × time with 2 workers), i.e. throughput(2) / (2 × throughput(1)).
3. Checkpoint cost at the default cadence, as a share of the training loop: the time the loop spends
   blocked on checkpoints (`checkpoint_seconds` in metrics.json: snapshot, RNG gather, waiting for the
   previous write), from the 1-worker runs.

Each run reports two times: the loop (`seconds` in metrics.json; the plain loop's own timer around the
same part) and end to end, the wall time of the whole command: interpreter start-up and imports, data
loading, `hvd.init()` (and `horovodrun`'s launch for 2 workers), the loop, the final checkpoint and saving
the model (the plain loop saves its state_dict too).

All runs: a compute-bound CNN (digits_cnn, 64 channels), one torch thread per process, the same seed.
Every repeat runs the three configurations in a rotated order, so a change in machine load hits all three
alike; medians, min-max and the per-repeat ratios are printed, with the load average.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from nightshift.data.demo import write_demo_dataset
from nightshift.train.config import TrainConfig

MODEL_KWARGS = {"channels": 64, "hidden": 64}  # conv-heavy, small gradients
GLOBAL_BATCH = 256
EPOCHS = 20  # 100 optimizer steps: 10 repeats of 3 configurations stay near 6 minutes on 2 quiet cores
REPEATS = 10
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))

PLAIN_LOOP = r"""
import json, math, sys, time
import torch, torch.nn.functional as F
from nightshift.datasets import load_split
from nightshift.models import build_model
data, batch, epochs, kwargs, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
torch.manual_seed(0)
train, val = load_split("digits", data, "train"), load_split("digits", data, "validation")
model = build_model("digits_cnn", input_shape=(1, 8, 8), num_classes=10, **kwargs)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
steps = math.ceil(len(train) / batch)
start = time.perf_counter()
for epoch in range(epochs):
    g = torch.Generator().manual_seed(epoch)
    order = torch.randperm(len(train), generator=g)
    for idx in order.split(batch):
        opt.zero_grad()
        F.cross_entropy(model(train.features[idx]), train.labels[idx]).backward()
        opt.step()
    with torch.no_grad():
        model.eval(); F.cross_entropy(model(val.features), val.labels); model.train()
seconds = time.perf_counter() - start
torch.save(model.state_dict(), out)
print(json.dumps({"seconds": seconds}))
"""

CONFIGS = ("1 worker", "2 workers", "plain loop")


def trainer_run(data: Path, workdir: Path, workers: int) -> dict[str, float]:
    out, ckpt = workdir / "out", workdir / "ckpt"
    args = [sys.executable, "-m", "nightshift.train", "--data", str(data), "--out", str(out),
            "--checkpoint-dir", str(ckpt), "--epochs", str(EPOCHS), "--batch-size", str(GLOBAL_BATCH // workers),
            "--model-kwargs", json.dumps(MODEL_KWARGS), "--threads", "1", "--log-every", "1000"]
    if workers > 1:
        args = [HOROVODRUN, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", *args]
    start = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["steps_run"] == summary["steps"], "a benchmark run resumed from an old checkpoint"
    return {"loop": summary["seconds"], "wall": wall, "checkpoint": summary["checkpoint_seconds"]}


def plain_run(data: Path, workdir: Path) -> dict[str, float]:
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PLAIN_LOOP, str(data), str(GLOBAL_BATCH), str(EPOCHS),
                             json.dumps(MODEL_KWARGS), str(workdir / "model.pt")],
                            check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    return {"loop": float(json.loads(result.stdout)["seconds"]), "wall": wall}


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} (1/5 min) on {os.cpu_count()} cores"


def spread(values: list[float], unit: str = "s") -> str:
    return (f"median {statistics.median(values):7.3f}{unit}  min {min(values):7.3f}  max {max(values):7.3f}  "
            f"n={len(values)}")


def main() -> None:
    default_every = TrainConfig(data=Path("."), out=Path("."), checkpoint_dir=Path(".")).checkpoint_every
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    print(f"trainer, {EPOCHS} epochs, global batch {GLOBAL_BATCH}, digits_cnn {MODEL_KWARGS}, checkpoint every "
          f"{default_every} steps, {REPEATS} repeats; {load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_demo_dataset(data, rows=1797, seed=0)
        measure: dict[str, Callable[[Path], dict[str, float]]] = {
            "1 worker": lambda d: trainer_run(data, d, 1),
            "2 workers": lambda d: trainer_run(data, d, 2),
            "plain loop": lambda d: plain_run(data, d),
        }
        for repeat in range(REPEATS):
            order = CONFIGS[repeat % 3:] + CONFIGS[:repeat % 3]  # rotate who goes first
            for name in order:
                before = os.getloadavg()[0]
                result = measure[name](Path(tempfile.mkdtemp(dir=tmp)))
                runs[name].append(result)
                print(f"  repeat {repeat + 1:2d}: {name:10s} loop {result['loop']:6.2f} s  "
                      f"end to end {result['wall']:6.2f} s  (load {before:.1f} before)", flush=True)
    print(f"after the runs: {load()}")
    loop = {name: [r["loop"] for r in results] for name, results in runs.items()}
    wall = {name: [r["wall"] for r in results] for name, results in runs.items()}
    for name in CONFIGS:
        print(f"  {name:10s} loop        {spread(loop[name])}")
        print(f"  {name:10s} end to end  {spread(wall[name])}")
        outside = [w - lp for w, lp in zip(wall[name], loop[name], strict=True)]
        print(f"  {name:10s} outside the loop (start-up, init, saving) {spread(outside)}")

    def ratios(label: str, of_medians: float, per_repeat: list[float], goal: str) -> None:
        print(f"{label}: {of_medians:.3f} from the medians; per repeat median {statistics.median(per_repeat):.3f} "
              f"(min {min(per_repeat):.3f}, max {max(per_repeat):.3f}) {goal}")

    med = {kind: {name: statistics.median(v) for name, v in times.items()}
           for kind, times in (("loop", loop), ("end to end", wall))}
    for kind, times in (("loop", loop), ("end to end", wall)):
        ratios(f"1. trainer / plain loop, {kind}", med[kind]["1 worker"] / med[kind]["plain loop"],
               [t / p for t, p in zip(times["1 worker"], times["plain loop"], strict=True)], "(goal <= 1.05x)")
        ratios(f"2. scaling efficiency 2 vs 1 worker, {kind}",
               med[kind]["1 worker"] / (2 * med[kind]["2 workers"]),
               [one / (2 * two) for one, two in zip(times["1 worker"], times["2 workers"], strict=True)],
               "(goal >= 0.90)")
    shares = [r["checkpoint"] / r["loop"] * 100 for r in runs["1 worker"]]
    ratios("3. checkpoint share of the loop, %", statistics.median(shares), shares, "(goal <= 3.5%)")
