"""Data gate benchmarks (issue 3), measured side by side in one run.

1. The GX digits suite against hand-written pandas checks of the same rules, on 1,000,000 rows.
2. Re-staging an unchanged ~1 GB dataset against `cp -r` of the same files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

COLUMNS = ["label"] + [f"pixel_{i}" for i in range(64)]


def pandas_checks(frame: pd.DataFrame) -> bool:
    """The suite's rules by hand: schema, dtypes, nulls, finite range, labels, rows, dups, balance."""
    ok = set(frame.columns) == set(COLUMNS)
    ok &= all(str(frame[c].dtype) == ("int64" if c == "label" else "float32") for c in COLUMNS)
    ok &= not frame[COLUMNS].isna().any().any()
    pixels = frame[COLUMNS[1:]].to_numpy()
    ok &= bool((np.isfinite(pixels) & (pixels >= 0) & (pixels <= 16)).all())
    ok &= bool(frame["label"].isin(range(10)).all())
    ok &= 100 <= len(frame) <= 10_000_000
    ok &= frame.duplicated(keep=False).mean() <= 0.01
    shares = frame["label"].value_counts(normalize=True)
    ok &= all(shares.get(v, 0.0) >= 0.05 for v in range(10))
    return bool(ok)


def best_of(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_validation(rows: int = 1_000_000, repeat: int = 3) -> None:
    from nightshift.data.demo import digits_frame
    from nightshift.data.validate import load_suite, validate_frame

    frame = digits_frame(rows, seed=0)
    suite = load_suite()
    assert pandas_checks(frame) and validate_frame(frame, suite, data_docs=False)[0]
    t_pandas = t_gx = float("inf")
    for _ in range(repeat):  # interleaved, so both see the same machine load
        t_pandas = min(t_pandas, best_of(lambda: pandas_checks(frame), 1))
        t_gx = min(t_gx, best_of(lambda: validate_frame(frame, suite, data_docs=False), 1))
    t_dups = best_of(lambda: frame.duplicated(keep=False), 1)
    t_docs = best_of(lambda: validate_frame(frame, suite, data_docs=True), 1) - t_gx
    print(f"validate {rows:,} rows: pandas {t_pandas:.2f}s  GX suite {t_gx:.2f}s  "
          f"ratio {t_gx / t_pandas:.2f}x (goal <= 2x)")
    print(f"  of which duplicate-row check (both sides) {t_dups:.2f}s; "
          f"GX minus pandas {t_gx - t_pandas:.2f}s; "
          f"Data Docs page adds {t_docs:.2f}s")


def _tree_copy(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)


def bench_restage(target_bytes: int = 1 << 30) -> None:
    from nightshift.data.demo import write_demo_dataset
    from nightshift.data.stage import stage_dataset, version_validated

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        os.environ["NIGHTSHIFT_HOME"] = str(root / "home")
        data = root / "data"
        rows = int(target_bytes / 264)  # float32 pixels with noise barely compress: ~264 bytes a row
        write_demo_dataset(data, rows=rows, seed=0)
        size = sum(p.stat().st_size for p in data.iterdir())
        start = time.perf_counter()
        first = stage_dataset(data, root / "ws-0")
        t_first = time.perf_counter() - start
        splits = first["splits"]

        def copy() -> None:
            shutil.rmtree(root / "cp", ignore_errors=True)
            _tree_copy(data, root / "cp")

        t_cp = best_of(copy, 3)
        counter = iter(range(1, 100))
        t_dvc = best_of(lambda: version_validated(data, root / f"ws-{next(counter)}", splits), 3)
        start = time.perf_counter()
        again = stage_dataset(data, root / "ws-full")
        t_full = time.perf_counter() - start
        assert again["hash"] == first["hash"]
        print(f"re-stage unchanged {size / 2**30:.2f} GiB ({rows:,} rows): cp -r {t_cp:.2f}s  "
              f"DVC re-stage {t_dvc:.3f}s  ratio {t_dvc / t_cp:.3f}x (goal <= 0.05x)")
        print(f"  whole `stage_dataset` again, validation included: {t_full:.1f}s "
              f"({t_full / t_cp:.1f}x cp); first staging (hash + copy into cache + push): {t_first:.1f}s")


def main() -> None:
    bench_validation()
    bench_restage()


if __name__ == "__main__":
    main()
