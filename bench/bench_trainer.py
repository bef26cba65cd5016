"""Trainer benchmarks (issue 2), each a ratio measured side by side in one run.

1. Data-parallel scaling: 2 Horovod workers vs 1 at the same global batch → efficiency
   = time with 1 worker / (2 × time with 2 workers), i.e. throughput(2) / (2 × throughput(1)).
2. Trainer overhead: `python -m nightshift.train` (1 process, default checkpoint cadence) against a
   minimal plain-PyTorch loop on the same model, data, batch and steps.
3. Checkpoint cost at the default cadence, as a share of training time: directly, the time the
   training loop spends blocked on checkpoints (`checkpoint_seconds` in metrics.json: snapshot,
   RNG gather, waiting for the previous write); and by difference, against the same run
   checkpointing only at the end (noisier: run-to-run spread on this VM is ~10%).

All runs: a compute-bound CNN (digits_cnn, 64 channels), one torch thread per process, the same
seed; runs are interleaved and repeated, and the median is reported.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from nightshift.data.demo import write_demo_dataset
from nightshift.train.config import TrainConfig

MODEL_KWARGS = {"channels": 64, "hidden": 64}  # conv-heavy, small gradients
GLOBAL_BATCH = 256
EPOCHS = 40
REPEATS = 3
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))

PLAIN_LOOP = r"""
import json, math, sys, time
import torch, torch.nn.functional as F
from nightshift.datasets import load_split
from nightshift.models import build_model
data, batch, epochs, kwargs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
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
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def trainer_summary(data: Path, workdir: Path, workers: int, *, checkpoint_every: int) -> dict[str, float]:
    out, ckpt = workdir / "out", workdir / "ckpt"
    args = [sys.executable, "-m", "nightshift.train", "--data", str(data), "--out", str(out),
            "--checkpoint-dir", str(ckpt), "--epochs", str(EPOCHS), "--batch-size", str(GLOBAL_BATCH // workers),
            "--model-kwargs", json.dumps(MODEL_KWARGS), "--threads", "1", "--log-every", "1000",
            "--checkpoint-every", str(checkpoint_every)]
    if workers > 1:
        args = [HOROVODRUN, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", *args]
    subprocess.run(args, check=True, capture_output=True, text=True)
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["steps_run"] == summary["steps"], "a benchmark run resumed from an old checkpoint"
    return summary  # type: ignore[no-any-return]


def plain_seconds(data: Path) -> float:
    result = subprocess.run([sys.executable, "-c", PLAIN_LOOP, str(data), str(GLOBAL_BATCH), str(EPOCHS),
                             json.dumps(MODEL_KWARGS)], check=True, capture_output=True, text=True)
    return float(json.loads(result.stdout)["seconds"])


def main() -> None:
    default_every = TrainConfig(data=Path("."), out=Path("."), checkpoint_dir=Path(".")).checkpoint_every
    times: dict[str, list[float]] = {"1 worker": [], "2 workers": [], "plain loop": [], "no checkpoints": []}
    blocked: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_demo_dataset(data, rows=1797, seed=0)
        for repeat in range(REPEATS):
            runs = {
                "1 worker": lambda d: trainer_summary(data, d, 1, checkpoint_every=default_every),
                "2 workers": lambda d: trainer_summary(data, d, 2, checkpoint_every=default_every),
                "plain loop": lambda d: {"seconds": plain_seconds(data)},
                "no checkpoints": lambda d: trainer_summary(data, d, 1, checkpoint_every=10**9),
            }
            for name, measure in runs.items():
                summary = measure(Path(tempfile.mkdtemp(dir=tmp)))
                times[name].append(summary["seconds"])
                if name == "1 worker":
                    blocked.append(summary["checkpoint_seconds"] / summary["seconds"])
                print(f"  repeat {repeat + 1}: {name:15s} {times[name][-1]:7.2f} s", flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    efficiency = median["1 worker"] / (2 * median["2 workers"])  # same global work, 2× the workers
    overhead = median["1 worker"] / median["plain loop"]
    checkpoint_share = statistics.median(blocked)
    checkpoint_difference = (median["1 worker"] - median["no checkpoints"]) / median["1 worker"]
    print(f"trainer, {EPOCHS} epochs, global batch {GLOBAL_BATCH}, digits_cnn {MODEL_KWARGS}, "
          f"checkpoint every {default_every} steps, median of {REPEATS}:")
    for name, value in median.items():
        print(f"  {name:15s} {value:7.2f} s")
    print(f"1. scaling efficiency 2 vs 1 worker: {efficiency:.3f} (goal >= 0.90)")
    print(f"2. trainer / plain loop:             {overhead:.3f}x (goal <= 1.05x)")
    print(f"3. checkpoint share of training:     {checkpoint_share * 100:.2f}% blocked in the loop (goal <= 3.5%); "
          f"{checkpoint_difference * 100:+.2f}% by wall-time difference")
