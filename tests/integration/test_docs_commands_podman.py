"""The podman part of the emulated hosts page (`nightshift run-mpijob --runtime podman`), run as written, as
tests/integration/test_docs_commands.py runs the other pages: in a fresh bash and NIGHTSHIFT_HOME, in a folder of
its own, `.venv/bin` on PATH. It needs the trainer image `localhost/nightshift/trainer:cpu`, which this test run
builds (tests/images_build.py; a module of tests/conftest.py's NEEDS_IMAGES, queued last and waiting for the build);
it skips, saying why, where podman cannot run here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs_commands import Reader, page_blocks, run_page
from tests.integration.test_docs_commands import reader_env
from tests.integration.test_run_mpijob_podman import MISSING

# Its autouse fixture `image`: this module's test waits for the run's image build, as that module's do.
from tests.integration.test_run_mpijob_podman import image as image

pytestmark = [pytest.mark.integration, pytest.mark.images]
if MISSING:
    pytestmark.append(pytest.mark.skip(reason=MISSING))
PAGE = "how-to/emulated-hosts.md"


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[Reader]:
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    for folder in (work, tmp):
        folder.mkdir()
    yield Reader(work, reader_env(tmp_path / "home", tmp, venv_on_path=True), tmp_path / "state")


def test_the_podman_runtime_runs_as_written(reader: Reader) -> None:
    podman_blocks = [b for b in page_blocks(PAGE) if "podman" in b.section]
    assert len(podman_blocks) == 1
    out = run_page(reader, PAGE, only=podman_blocks, timeout_s=600)
    # each pod's lines, prefixed with its name (the job's: train-<hash>-try<the task's try number>), and success
    (job,) = set(re.findall(r"MPIJob (train-[0-9a-f]+-try1) succeeded", out))
    assert f"[{job}-launcher] " in out and f"[{job}-worker-1] " in out
    [home] = {p.parents[3] for p in Path(reader.env["TMPDIR"]).glob("*/workspaces/nightly_retrain/try2/model")}
    metrics = home / "workspaces" / "nightly_retrain" / "try2" / "model" / "metrics.json"
    assert metrics.is_file()
    # what the pods wrote through the claim's view stays the claim owner's, as the page says
    assert os.stat(metrics).st_uid == 1000
