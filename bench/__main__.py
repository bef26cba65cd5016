"""Run every benchmark (`python -m bench`), or those named: `python -m bench trainer data`. Options after the names
are the named benchmark's own (`python -m bench season --nights 6`): it reads them from sys.argv."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# Second modes of a module, run with every benchmark or when named exactly: `python -m bench multihost-steps`.
MODES = {"multihost-steps": ("bench_multihost", "main_steps")}


def main(argv: list[str]) -> int:
    first_option = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    argv = argv[:first_option]
    names = sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    wanted = [(n, "main") for n in names if not argv or any(a in n for a in argv)]
    wanted += [module for mode, module in MODES.items() if not argv or mode in argv]
    status = 0
    for name, function in wanted:
        print(f"== {name}" + ("" if function == "main" else f".{function}"), flush=True)
        code = getattr(importlib.import_module(f"bench.{name}"), function)()
        status = status or (code if isinstance(code, int) else 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
