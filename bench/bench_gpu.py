"""The trainer on a GPU (issue 16): its step time on CUDA in fp32, bf16 and fp16, against the same run on
the CPU (torch's thread count the trainer picks by default, one per core, and 1 thread) and against a plain
PyTorch loop on the same GPU (the trainer's overhead there).

Two model sizes, each run by every configuration with the same data, batch and steps:

- demo: the demo run as shipped: `digits_cnn` with its defaults (32 channels, 128-unit head, 0.15 M
  parameters), the 1,797-row demo dataset (1,257 training rows), batch 32, 5 epochs (200 steps). Too
  small to keep a GPU busy: it measures per-step latency (kernel launches, Python), not arithmetic.
- large: `digits_cnn` with 128 channels and a 256-unit head (1.35 M parameters), 12,000 rows (8,400
  training rows, the bundled images repeated with seeded noise), batch 512, 2 epochs (34 steps): about
  61 GFLOP a step, enough work for the GPU to matter while the 1-thread CPU run stays under a minute (on
  an H100 still bound by kernel launches in bf16: bench/RESULTS.md).

Each run gives three times: **loop** (the training loop: `seconds` in metrics.json, the plain loop's own
timer around the same part; it includes the first steps' CUDA/cuDNN warm-up, the per-epoch validation
and the trainer's checkpoints), **step** (steady state: the median over windows of `log_every` steps,
the first window left out, of the window's time per step; windows that hold an epoch's validation or a
checkpoint are a minority the median ignores) and **end to end** (the wall time of the whole command).

On the GPU the trainer runs with its determinism settings (no TF32, deterministic cuDNN and cuBLAS); the
plain loop sets the same, so both do the same arithmetic. It skips, saying why, without a GPU or without
a Horovod built with CUDA.

Environment: NIGHTSHIFT_BENCH_GPU_REPEATS (default 3), NIGHTSHIFT_BENCH_GPU_SIZES (default "demo,large"),
NIGHTSHIFT_BENCH_GPU_JSONL (a file each run's raw result is appended to), NIGHTSHIFT_BENCH_GPU_BASELINE (a
directory holding another version's `nightshift` package: its trainer's three CUDA runs join the rotation,
named "baseline trainer ...", to compare two versions side by side).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nightshift.data.demo import write_demo_dataset


@dataclass(frozen=True)
class Size:
    model_kwargs: dict[str, int]
    batch: int
    rows: int
    epochs: int
    log_every: int


SIZES = {
    "demo": Size(model_kwargs={}, batch=32, rows=1797, epochs=5, log_every=10),
    "large": Size(model_kwargs={"channels": 128, "hidden": 256}, batch=512, rows=12000, epochs=2, log_every=4),
}


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "trainer" or "plain"
    device: str  # "cuda" or "cpu"
    precision: str
    threads: int = 0  # 0: the trainer's default (cores / local processes)
    checkout: str | None = None  # another checkout's directory holding `nightshift` (a baseline trainer)


CONFIGS = (
    Config("trainer cuda fp32", "trainer", "cuda", "fp32"),
    Config("trainer cuda bf16", "trainer", "cuda", "bf16"),
    Config("trainer cuda fp16", "trainer", "cuda", "fp16"),
    Config("plain cuda fp32", "plain", "cuda", "fp32"),
    Config("plain cuda bf16", "plain", "cuda", "bf16"),
    Config("trainer cpu fp32 default threads", "trainer", "cpu", "fp32"),
    Config("trainer cpu fp32 1 thread", "trainer", "cpu", "fp32", threads=1),
)

PLAIN_LOOP = r"""
import json, os, sys, time
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch, torch.nn.functional as F
from nightshift.datasets import load_split
from nightshift.models import build_model
data, batch, epochs, kwargs, precision, window, out = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                       json.loads(sys.argv[4]), sys.argv[5], int(sys.argv[6]),
                                                       sys.argv[7])
dev = torch.device("cuda")
torch.backends.cudnn.benchmark = False
torch.backends.cudnn.deterministic = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.use_deterministic_algorithms(True, warn_only=True)
torch.manual_seed(0)
train, val = load_split("digits", data, "train"), load_split("digits", data, "validation")
x, y = train.features.to(dev), train.labels.to(dev)
vx, vy = val.features.to(dev), val.labels.to(dev)
model = build_model("digits_cnn", input_shape=tuple(train.input_shape), num_classes=train.num_classes,
                    **kwargs).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
dtype = torch.float16 if precision == "fp16" else torch.bfloat16
step, marks = 0, []
start = time.perf_counter()
for epoch in range(epochs):
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))
    for idx in order.split(batch):
        idx = idx.to(dev, non_blocking=True)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=precision != "fp32"):
            loss = F.cross_entropy(model(x[idx]), y[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        step += 1
        if step % window == 0:
            torch.cuda.synchronize()
            marks.append(time.perf_counter() - start)
    model.eval()
    with torch.no_grad():
        val_loss = sum(float(F.cross_entropy(model(vx[i:i + 1024]), vy[i:i + 1024], reduction="sum"))
                       for i in range(0, len(vx), 1024))
    model.train()
torch.cuda.synchronize()
seconds = time.perf_counter() - start
torch.save(model.state_dict(), out)
print(json.dumps({"seconds": seconds, "steps": step, "marks": marks}))
"""


def environment() -> str:
    import torch

    lines = [f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
             f"cuDNN {torch.backends.cudnn.version()}"]
    if torch.cuda.is_available():
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True)
        lines.append(f"GPU: {smi.stdout.strip() or torch.cuda.get_device_name(0)}")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines.append(f"CPU: {cpu}, {os.cpu_count()} logical CPUs")
    return "\n".join(lines)


def skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no GPU: torch.cuda.is_available() is False"
    try:
        import horovod.torch as hvd
    except ImportError as err:
        return f"Horovod cannot be imported ({err})"
    if not hvd.cuda_built():
        return "Horovod here was built without CUDA (hvd.cuda_built() is False)"
    return None


def window_steps(times: list[float]) -> list[float]:
    """Seconds per step of each window after the first, from the windows' end times (same steps each)."""
    return [b - a for a, b in itertools.pairwise(times)]


def configs() -> tuple[Config, ...]:
    baseline = os.environ.get("NIGHTSHIFT_BENCH_GPU_BASELINE")
    if not baseline:
        return CONFIGS
    if not (Path(baseline) / "nightshift" / "train" / "trainer.py").is_file():
        raise SystemExit(f"NIGHTSHIFT_BENCH_GPU_BASELINE={baseline!r} holds no nightshift/train/trainer.py")
    return CONFIGS + tuple(Config(f"baseline {c.name}", c.kind, c.device, c.precision, checkout=baseline)
                           for c in CONFIGS if c.kind == "trainer" and c.device == "cuda")


def trainer_run(config: Config, size: Size, data: Path, workdir: Path) -> dict[str, Any]:
    out, ckpt = workdir / "out", workdir / "ckpt"
    args = [sys.executable, "-m", "nightshift.train", "--data", str(data), "--out", str(out),
            "--checkpoint-dir", str(ckpt), "--epochs", str(size.epochs), "--batch-size", str(size.batch),
            "--model-kwargs", json.dumps(size.model_kwargs), "--log-every", str(size.log_every),
            "--device", config.device, "--precision", config.precision, "--threads", str(config.threads)]
    env = dict(os.environ)
    if config.checkout:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (config.checkout, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{config.name} failed ({result.returncode}): {result.stderr[-2000:]}")
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["steps_run"] == summary["steps"], "a benchmark run resumed from an old checkpoint"
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # samples_per_sec of a window = steps × batch / seconds: seconds per step = batch / rate.
    per_step = [size.batch / w["samples_per_sec"] for w in windows if w.get("event") == "step"][1:]
    threads = re.search(r"(\d+) torch threads", result.stderr)
    return {"loop": summary["seconds"], "wall": wall, "steps": summary["steps"],
            "step": statistics.median(per_step), "threads": int(threads.group(1)) if threads else None,
            "checkpoint": summary["checkpoint_seconds"], "val_accuracy": summary.get("val_accuracy")}


def plain_run(config: Config, size: Size, data: Path, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PLAIN_LOOP, str(data), str(size.batch), str(size.epochs),
                             json.dumps(size.model_kwargs), config.precision, str(size.log_every),
                             str(workdir / "model.pt")], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{config.name} failed ({result.returncode}): {result.stderr[-2000:]}")
    loop = json.loads(result.stdout.splitlines()[-1])
    per_step = [w / size.log_every for w in window_steps(loop["marks"])]
    return {"loop": loop["seconds"], "wall": wall, "steps": loop["steps"], "step": statistics.median(per_step)}


def spread(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    return (f"{statistics.median(values) * scale:8.3f}{unit} ({min(values) * scale:.3f}-"
            f"{max(values) * scale:.3f})")


def report(size_name: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    print(f"-- {size_name}: median (min-max) of {len(next(iter(runs.values())))} runs")
    print(f"  {'configuration':42s} {'loop':>22s} {'step (steady)':>24s} {'end to end':>22s}")
    for name, results in runs.items():
        threads = sorted({int(r["threads"]) for r in results if " cpu " in name and r.get("threads")})
        label = name + (f" ({'/'.join(map(str, threads))} thr)" if threads else "")
        print(f"  {label:42s} {spread([r['loop'] for r in results]):>22s} "
              f"{spread([r['step'] for r in results], 1000, 'ms'):>24s} {spread([r['wall'] for r in results]):>22s}")
    med = {name: {k: statistics.median(r[k] for r in results) for k in ("loop", "step", "wall")}
           for name, results in runs.items()}

    def ratio(a: str, b: str, what: str) -> None:
        if a in med and b in med:
            print(f"  {what}: loop {med[a]['loop'] / med[b]['loop']:.2f}x, step {med[a]['step'] / med[b]['step']:.2f}x,"
                  f" end to end {med[a]['wall'] / med[b]['wall']:.2f}x")

    ratio("trainer cpu fp32 default threads", "trainer cuda fp32", "CPU (default threads) / GPU, fp32")
    ratio("trainer cpu fp32 1 thread", "trainer cuda fp32", "CPU (1 thread) / GPU, fp32")
    ratio("trainer cuda fp32", "trainer cuda bf16", "GPU fp32 / bf16")
    ratio("trainer cuda fp32", "trainer cuda fp16", "GPU fp32 / fp16")
    ratio("trainer cuda fp32", "plain cuda fp32", "trainer / plain loop, GPU fp32")
    ratio("trainer cuda bf16", "plain cuda bf16", "trainer / plain loop, GPU bf16")
    for precision in ("fp32", "bf16", "fp16"):
        ratio(f"baseline trainer cuda {precision}", f"trainer cuda {precision}",
              f"baseline / this trainer, GPU {precision}")


def main() -> None:
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return
    repeats = int(os.environ.get("NIGHTSHIFT_BENCH_GPU_REPEATS", "3"))
    sizes = os.environ.get("NIGHTSHIFT_BENCH_GPU_SIZES", "demo,large").split(",")
    raw = os.environ.get("NIGHTSHIFT_BENCH_GPU_JSONL")
    print(environment(), flush=True)
    measure = {"trainer": trainer_run, "plain": plain_run}
    with tempfile.TemporaryDirectory() as tmp:
        for size_name in sizes:
            size = SIZES[size_name]
            data = Path(tmp) / f"data-{size_name}"
            write_demo_dataset(data, rows=size.rows, seed=0)
            print(f"== {size_name}: digits_cnn {size.model_kwargs or 'defaults'}, {size.rows} rows, batch "
                  f"{size.batch}, {size.epochs} epochs, {repeats} repeats", flush=True)
            chosen = configs()
            runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in chosen}
            for repeat in range(repeats):
                shift = repeat % len(chosen)
                for config in chosen[shift:] + chosen[:shift]:  # rotate who goes first
                    result = measure[config.kind](config, size, data, Path(tempfile.mkdtemp(dir=tmp)))
                    runs[config.name].append(result)
                    print(f"  repeat {repeat + 1}: {config.name:39s} loop {result['loop']:7.3f} s  step "
                          f"{result['step'] * 1000:8.3f} ms  end to end {result['wall']:6.2f} s", flush=True)
                    if raw:
                        with open(raw, "a") as handle:
                            handle.write(json.dumps({"size": size_name, "config": config.name, "repeat": repeat,
                                                     **result}) + "\n")
            report(size_name, runs)
