"""Data gate benchmarks (issues 3 and 13), each side measured in the same run, interleaved.

1. The GX digits suite (`validate_frame`, result format BOOLEAN_ONLY, no Data Docs) against the same
   rules written by hand the way a good engineer would: vectorised numpy/pandas and a hash-based
   duplicate check (`pd.util.hash_pandas_object(frame, index=False).duplicated(keep=False)`), at
   1,000,000 and 10,000,000 rows (the largest that fits in memory with headroom, if 10M does not).
2. Re-staging an unchanged ~1 GB dataset into the workspace it was staged into (the staging record
   answers before DVC is opened) against `cp -r` of the same files; for comparison, the DVC path on the
   same data into a new workspace, and the `nightshift stage` command with its Python start-up.

Timings on a shared machine are noisy: every measurement is repeated with the two sides alternating, and
the median and the spread (min-max) are printed with the load average before and after.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

COLUMNS = ["label"] + [f"pixel_{i}" for i in range(64)]
PIXELS = COLUMNS[1:]
VALIDATION_SIZES = {1_000_000: 7, 10_000_000: 3}  # rows: interleaved repeats of each side
BYTES_PER_ROW = 4 * 64 + 8
HEADROOM = 3.0  # the frame, plus the largest temporaries of either side (hashes, masks), plus slack


def pandas_checks(frame: pd.DataFrame) -> bool:
    """The suite's rules by hand: schema, dtypes, nulls, finite range, labels, rows, duplicates, balance."""
    ok = set(frame.columns) == set(COLUMNS)
    ok &= all(str(frame[c].dtype) == ("int64" if c == "label" else "float32") for c in COLUMNS)
    ok &= not frame.isna().to_numpy().any()
    pixels = frame[PIXELS].to_numpy()
    # min/max of the whole block: NaN or an infinity fails the comparison, so this is also the finite check
    ok &= bool(pixels.min() >= 0 and pixels.max() <= 16)
    ok &= bool(frame["label"].isin(range(10)).all())
    ok &= 100 <= len(frame) <= 10_000_000
    ok &= pd.util.hash_pandas_object(frame, index=False).duplicated(keep=False).mean() <= 0.01
    shares = frame["label"].value_counts(normalize=True)
    ok &= all(shares.get(v, 0.0) >= 0.05 for v in range(10))
    return bool(ok)


def digits_like(rows: int, seed: int = 0) -> pd.DataFrame:
    """A table like the demo data (digits images plus seeded float32 noise, clipped to 0..16, no duplicate
    rows), built in place chunk by chunk so 10M rows need only the table's own memory."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images, labels = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    # Column-major, as a table read from Parquet is: each column contiguous in memory.
    columns = np.empty((64, rows), dtype=np.float32)
    label = np.empty(rows, dtype=np.int64)
    chunk = 1 << 18
    noise = np.empty((chunk, 64), dtype=np.float32)
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        index = rng.integers(0, len(labels), size=stop - start)
        block = noise[: stop - start]
        rng.standard_normal(size=block.shape, dtype=np.float32, out=block)
        block *= np.float32(0.5)
        block += images[index]
        np.clip(block, 0.0, 16.0, out=block)
        columns[:, start:stop] = block.T
        label[start:stop] = labels[index]
    frame = pd.DataFrame(columns.T, columns=PIXELS, copy=False)
    frame.insert(0, "label", label)
    return frame


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping others out)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} (1/5 min) on {os.cpu_count()} cores"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}s (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def bench_validation(rows: int, repeat: int) -> dict[str, float] | None:
    need = rows * BYTES_PER_ROW * HEADROOM
    if available_bytes() < need:
        print(f"validate {rows:,} rows: skipped, {available_bytes() / 2**30:.1f} GiB available, "
              f"{need / 2**30:.1f} GiB wanted (table plus temporaries)")
        return None
    result = compare_validation(digits_like(rows), repeat)
    gc.collect()
    return result


def compare_validation(frame: pd.DataFrame, repeat: int) -> dict[str, float]:
    from nightshift.data.validate import load_suite, validate_frame

    suite = load_suite()
    assert pandas_checks(frame) and validate_frame(frame, suite, data_docs=False)[0]
    print(f"validate {len(frame):,} rows ({frame.memory_usage().sum() / 2**30:.2f} GiB in memory), {load()}",
          flush=True)
    t_pandas: list[float] = []
    t_gx: list[float] = []
    for i in range(repeat):  # alternate which side goes first, so a load change hits both alike
        sides = [(t_pandas, lambda: pandas_checks(frame)),
                 (t_gx, lambda: validate_frame(frame, suite, data_docs=False))]
        for times, fn in sides if i % 2 == 0 else sides[::-1]:
            gc.collect()
            times.append(timed(fn))
    t_hash = [timed(lambda: pd.util.hash_pandas_object(frame, index=False).duplicated(keep=False))
              for _ in range(3)]
    ratios = [g / p for g, p in zip(t_gx, t_pandas, strict=True)]
    ratio = statistics.median(t_gx) / statistics.median(t_pandas)
    print(f"  pandas/numpy   {spread(t_pandas)}")
    print(f"  GX suite       {spread(t_gx)}")
    print(f"  ratio of medians {ratio:.2f}x (goal <= 2x); per-pair ratios median {statistics.median(ratios):.2f}, "
          f"min {min(ratios):.2f}, max {max(ratios):.2f}")
    print(f"  of which the row hash + duplicated (both sides): {spread(t_hash)}; {load()}", flush=True)
    return {"rows": len(frame), "pandas": statistics.median(t_pandas), "gx": statistics.median(t_gx),
            "ratio": ratio}


def bench_data_docs(rows: int = 1_000_000) -> None:
    """What the Data Docs page adds on top of a validation (a fixed cost, not per row)."""
    from nightshift.data.validate import load_suite, validate_frame

    frame = digits_like(rows)
    suite = load_suite()
    without = [timed(lambda: validate_frame(frame, suite, data_docs=False)) for _ in range(2)]
    with_docs = [timed(lambda: validate_frame(frame, suite, data_docs=True)) for _ in range(2)]
    print(f"Data Docs page on {rows:,} rows adds {min(with_docs) - min(without):.2f}s "
          f"(best of 2 with and without); {load()}")


def _tree_copy(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)


RESTAGE_ROUNDS = 5  # each round: one `cp -r`, then RESTAGE_PER_ROUND re-stagings
RESTAGE_PER_ROUND = 3


def bench_restage(target_bytes: int = 1 << 30) -> None:
    """Re-staging an unchanged ~1 GB dataset into the workspace it was staged into, against `cp -r`."""
    from nightshift.data.demo import write_demo_dataset
    from nightshift.data.stage import stage_dataset, version_validated

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        os.environ["NIGHTSHIFT_HOME"] = str(root / "home")
        data = root / "data"
        rows = int(target_bytes / 264)  # float32 pixels with noise barely compress: ~264 bytes a row
        write_demo_dataset(data, rows=rows, seed=0)
        size = sum(p.stat().st_size for p in data.iterdir())
        workspace = root / "ws"
        t_first = timed(lambda: stage_dataset(data, workspace))
        first = stage_dataset(data, workspace)
        print(f"re-stage unchanged {size / 2**30:.2f} GiB ({rows:,} rows), {load()}", flush=True)

        def copy() -> None:
            shutil.rmtree(root / "cp", ignore_errors=True)
            _tree_copy(data, root / "cp")

        t_cp: list[float] = []
        t_fast: list[float] = []
        for _ in range(RESTAGE_ROUNDS):  # interleaved: a load change hits both
            t_cp.append(timed(copy))
            for _ in range(RESTAGE_PER_ROUND):
                t_fast.append(timed(lambda: stage_dataset(data, workspace)))
        assert stage_dataset(data, workspace) == first
        ratio = statistics.median(t_fast) / statistics.median(t_cp)
        print(f"  cp -r                                   {spread(t_cp)}")
        print(f"  stage_dataset, same workspace (record)  {spread(t_fast)}")
        print(f"  ratio of medians {ratio:.4f}x (goal <= 0.05x); worst re-stage / best cp "
              f"{max(t_fast) / min(t_cp):.4f}x")

        # For comparison: the DVC path on the same unchanged data (new workspaces, so no record applies).
        splits = first["splits"]
        counter = iter(range(1, 100))
        t_dvc = [timed(lambda: version_validated(data.resolve(), root / f"ws-{next(counter)}", splits))
                 for _ in range(3)]
        t_full = timed(lambda: stage_dataset(data, root / "ws-full"))
        cli = [str(Path(sys.executable).with_name("nightshift")), "stage", str(data), "--workspace", str(workspace)]
        t_cli = [timed(lambda: subprocess.run(cli, check=True, capture_output=True)) for _ in range(3)]
        print(f"  DVC path into a new workspace (unchanged data, no validation): {spread(t_dvc)} "
              f"= {statistics.median(t_dvc) / statistics.median(t_cp):.3f}x cp")
        print(f"  whole stage_dataset into a new workspace (validation + DVC): {t_full:.1f}s "
              f"({t_full / statistics.median(t_cp):.1f}x cp); first staging (validation, hash, copy into "
              f"cache, push): {t_first:.1f}s")
        print(f"  `nightshift stage` CLI re-stage, same workspace (Python start-up and imports included): "
              f"{spread(t_cli)}; {load()}", flush=True)


def main() -> None:
    saved = os.environ.get("NIGHTSHIFT_HOME")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-data-home-") as home:
            os.environ["NIGHTSHIFT_HOME"] = home  # Data Docs sites and DVC state of the benchmark go here
            for rows, repeat in VALIDATION_SIZES.items():
                bench_validation(rows, repeat)
            bench_data_docs()
            bench_restage()
    finally:  # `python -m bench` runs the other benchmarks in this process
        if saved is None:
            os.environ.pop("NIGHTSHIFT_HOME", None)
        else:
            os.environ["NIGHTSHIFT_HOME"] = saved


if __name__ == "__main__":
    main()
