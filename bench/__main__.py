"""Run every benchmark (`python -m bench`), or those named: `python -m bench trainer data`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# Second modes of a module, run with every benchmark or when named exactly: `python -m bench multihost-steps`.
MODES = {"multihost-steps": ("bench_multihost", "main_steps")}


def main(argv: list[str]) -> int:
    names = sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    wanted = [(n, "main") for n in names if not argv or any(a in n for a in argv)]
    wanted += [module for mode, module in MODES.items() if not argv or mode in argv]
    for name, function in wanted:
        print(f"== {name}" + ("" if function == "main" else f".{function}"), flush=True)
        getattr(importlib.import_module(f"bench.{name}"), function)()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
