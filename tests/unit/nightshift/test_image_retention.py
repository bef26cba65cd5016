"""Retention of podman images (nightshift.image_retention): which images of superseded `make images` builds go.

`data/podman_images.json` has the shape of podman 4.3's `podman images --all --format json` (the fields of
cmd/podman/images/list.go's writeJSON: RepoTags null, Names, History and Dangling left out when empty, an image
with two names listed twice), for a store after `make images` ran twice: current builds, superseded ones (one a
container still runs, one a restamp built on, one in a read-only store), the unnamed cache of a build stage and an
image that is none of ours. It was written from podman's source, not recorded: no podman command may touch this
machine's images while a CI rehearsal builds them (see /work/results-gc.md for the real check left to do).
No podman runs here: a fake runner answers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from nightshift import image_retention
from nightshift.image_retention import ImageGcFailed, collect, collect_images, plan

LISTING = json.loads((Path(__file__).parent / "data" / "podman_images.json").read_text())
ROOT = Path(__file__).resolve().parents[3]


def image_id(name: str) -> str:
    """The fixture's ids: sha256 of a short name."""
    return hashlib.sha256(name.encode()).hexdigest()


def decided() -> dict[str, tuple[bool, str]]:
    names = {image_id(n): n for n in ("debian", "py-layer1", "python", "horovod-stage", "trainer-layer", "trainer-old",
                                      "trainer-older-running", "trainer", "serving-built-old", "serving-old",
                                      "serving", "airflow", "airflow-ro", "redis-old", "python-old")}
    return {names[d.image_id]: (d.remove, d.reason) for d in plan(LISTING)}


def test_only_superseded_nightshift_builds_that_nothing_holds_go() -> None:
    result = decided()
    going = {name for name, (remove, _) in result.items() if remove}
    assert going == {"trainer-old", "serving-old", "python-old"}
    assert result["trainer-old"][1] == ("a superseded build of localhost/nightshift/trainer:cpu: no name, no "
                                        "container, no child image (the tag moved to a newer build)")
    assert result["trainer-older-running"] == (
        False, "a superseded build of localhost/nightshift/trainer:cpu, used by 2 container(s) (running or stopped): "
               "kept while a container holds it")
    assert result["serving-built-old"][0] is False and "parent of 1 image(s)" in result["serving-built-old"][1]
    assert result["airflow-ro"][0] is False and "read-only" in result["airflow-ro"][1]
    assert result["trainer"] == (False, "tagged localhost/nightshift/trainer:cpu: the current build")
    assert result["airflow"][1].startswith("tagged localhost/nightshift/airflow:0.1.0, localhost/team/airflow:pinned")
    # Never a candidate: the unnamed layer cache of build stages (the Horovod compile), intermediate layers, the
    # debootstrapped base, another project's superseded image.
    assert not {"horovod-stage", "py-layer1", "trainer-layer", "debian", "redis-old"} & result.keys()


def test_an_image_listed_once_per_name_is_decided_once() -> None:
    ids = [d.image_id for d in plan(LISTING)]
    assert len(ids) == len(set(ids)) and ids.count(image_id("airflow")) == 1


class FakePodman:
    """Answers `images` with the fixture and `rmi` with the exit status given per image."""

    def __init__(self, rmi: dict[str, int] | None = None, listing: Any = None) -> None:
        self.rmi = rmi or {}
        self.listing = LISTING if listing is None else listing
        self.asked: list[list[str]] = []

    def __call__(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.asked.append(list(args))
        if args[0] == "images":
            return subprocess.CompletedProcess(list(args), 0, json.dumps(self.listing), "")
        code = self.rmi.get(args[1], 0)
        errors = {2: "Error: image used by 1c2d3e: image is in use by a container", 125: "Error: storage is broken"}
        return subprocess.CompletedProcess(list(args), code, "", errors.get(code, ""))


def test_a_dry_run_lists_and_removes_nothing_and_a_collection_removes_each_by_id() -> None:
    podman = FakePodman()
    dry = collect(podman, dry_run=True)
    assert [a[0] for a in podman.asked] == ["images"]
    assert podman.asked[0] == ["images", "--all", "--format", "json"]
    assert {e["id"] for e in dry["remove"]} == {image_id("trainer-old"), image_id("serving-old"),
                                                 image_id("python-old")}
    assert dry["removed_bytes"] == 0 and all(e["reason"] for e in dry["remove"] + dry["keep"])
    done = collect(podman, dry_run=False)
    assert sorted(a for a in podman.asked if a[0] == "rmi") == sorted(
        ["rmi", image_id(n)] for n in ("trainer-old", "serving-old", "python-old"))  # never --force
    assert done["removed_bytes"] == 1_400_000_000 + 1_100_000_000 + 260_000_000


def test_an_image_a_container_took_since_the_listing_is_kept_and_other_failures_are_loud() -> None:
    taken = collect(FakePodman(rmi={image_id("trainer-old"): 2}), dry_run=False)
    (kept,) = [e for e in taken["keep"] if e["id"] == image_id("trainer-old")]
    assert kept["reason"].startswith("podman refused to remove it") and "in use by a container" in kept["reason"]
    assert image_id("trainer-old") not in {e["id"] for e in taken["remove"]}
    gone = collect(FakePodman(rmi={image_id("serving-old"): 1}), dry_run=False)  # removed meanwhile: fine
    assert image_id("serving-old") in {e["id"] for e in gone["remove"]}
    with pytest.raises(ImageGcFailed, match=r"podman rmi \w{12}` failed \(exit 125\): Error: storage is broken"):
        collect(FakePodman(rmi={image_id("python-old"): 125}), dry_run=False)


@pytest.mark.parametrize("answer", ["not json", "{}", "[1]"])
def test_a_listing_that_is_not_podmans_removes_nothing(answer: str) -> None:
    podman = FakePodman()

    def run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        podman.asked.append(list(args))
        return subprocess.CompletedProcess(list(args), 0, answer, "")

    with pytest.raises(ImageGcFailed, match="nothing was removed"):
        collect(run, dry_run=False)
    assert all(a[0] == "images" for a in podman.asked)


def test_nothing_is_looked_at_while_an_image_build_holds_the_lock(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(image_retention, "LOCK_FILE", tmp_path / "images.lock")
    podman = FakePodman()
    with image_retention.build_lock() as held:  # as scripts/images.py holds it for a build
        assert held
        result = collect_images(run=podman)
    assert result["remove"] == [] and "an image build holds" in result["skipped"] and podman.asked == []
    assert {e["id"] for e in collect_images(run=podman)["remove"]} == {
        image_id(n) for n in ("trainer-old", "serving-old", "python-old")}


def _images_script() -> Any:
    spec = importlib.util.spec_from_file_location("images_script", ROOT / "scripts" / "images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_build_and_the_collection_share_one_lock() -> None:
    assert _images_script().LOCK_FILE == image_retention.LOCK_FILE


def test_make_images_removes_superseded_builds_after_its_builds_unless_told_to_keep_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = _images_script()
    podman = FakePodman()
    built: list[str] = []
    monkeypatch.setattr(images, "LOCK_FILE", tmp_path / "images.lock")
    monkeypatch.setattr(images, "check_tools", lambda: None)
    monkeypatch.setattr(images, "ca_bundle", lambda: tmp_path / "ca.pem")
    monkeypatch.setattr(images, "git_commit", lambda: "abc")
    monkeypatch.setattr(images, "ensure_debian_base", lambda: None)
    monkeypatch.setattr(images, "build", lambda dockerfile, tag, args, secret: built.append(tag))
    monkeypatch.setattr(images, "size", lambda tag: "1 MB")
    monkeypatch.setattr(images, "run", lambda cmd, **kwargs: podman(cmd[3:]))  # cmd: podman --runtime runc ...
    assert images.main(["--only", "airflow"]) == 0
    assert built[-1].startswith("localhost/nightshift/airflow:")
    assert sorted(a[1] for a in podman.asked if a[0] == "rmi") == sorted(
        image_id(n) for n in ("trainer-old", "serving-old", "python-old"))
    assert "removed " + image_id("trainer-old")[:12] in capsys.readouterr().out
    podman.asked.clear()
    assert images.main(["--only", "airflow", "--keep-superseded"]) == 0
    assert podman.asked == []


def test_make_images_still_succeeds_when_the_collection_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    images = _images_script()
    podman = FakePodman(rmi={image_id("trainer-old"): 125})
    monkeypatch.setattr(images, "run", lambda cmd, **kwargs: podman(cmd[3:]))
    images.remove_superseded()
    assert "superseded images were not all removed" in capsys.readouterr().err


def test_the_cli_collects_images_only_and_says_what_and_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from nightshift.cli import main

    podman = FakePodman()
    monkeypatch.setattr(image_retention, "LOCK_FILE", tmp_path / "images.lock")
    monkeypatch.setattr(image_retention, "_podman", lambda: podman)
    assert main(["gc", "--images", "--dry-run"]) == 0
    result = json.loads(capsys.readouterr().out)["images"]
    assert result["dry_run"] and {e["what"] for e in result["remove"]} == {
        image_id(n)[:12] for n in ("trainer-old", "serving-old", "python-old")}
    assert all(a[0] == "images" for a in podman.asked)
    assert main(["gc", "--images", "--pipeline", "nightly_retrain"]) == 2
    assert "--images collects podman images, which belong to no pipeline" in capsys.readouterr().err
