"""Test helper: an installed Horovod distribution laid out as pip lays one out (dist-info and package), whose torch
extension, Gloo support and join patch are there or not, for `nightshift doctor`'s checks. Put its folder first on
sys.path (or PYTHONPATH, for a child) and it is the Horovod that `importlib.metadata` and `import horovod` find."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from nightshift.doctor import JOIN_PATCH_MARKER

# What Horovod's own check says when the torch extension is missing (horovod.common.util.check_extension).
NOT_BUILT = "Extension horovod.torch has not been built: {path} not found"


def fake_horovod(site: Path, *, torch: bool = True, gloo: bool = True, join_patch: bool = True,
                 crash: bool = False) -> Path:
    """A Horovod 0.28.1 under `site`: with its torch extension (`torch`; carrying the join patch's marker when
    `join_patch`), `gloo_built()` answering `gloo`; `crash`: importing horovod kills the interpreter."""
    info = site / "horovod-0.28.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n")
    package = site / "horovod"
    for sub in ("", "common", "torch"):
        (package / sub).mkdir(parents=True, exist_ok=True)
        (package / sub / "__init__.py").write_text("")
    if crash:
        (package / "__init__.py").write_text("import os\nos._exit(3)\n")
    (package / "common" / "util.py").write_text(f"def gloo_built(verbose=False):\n    return {gloo!r}\n")
    extension = package / "torch" / f"mpi_lib_v2{sysconfig.get_config_var('EXT_SUFFIX')}"
    if torch:
        marker = JOIN_PATCH_MARKER if join_patch else b"HOROVOD_GLOO_TIMEOUT_SECONDS"
        extension.write_bytes(b"\x7fELF" + b"\0" * 64 + marker + b"\0" * 64)
    else:
        (package / "torch" / "__init__.py").write_text(f"raise ImportError({NOT_BUILT.format(path=extension)!r})\n")
    return site
