#!/usr/bin/env python3
"""Build the three Nightshift images with podman, from the repository's own Dockerfiles (`make images`).

    localhost/nightshift/trainer:cpu           images/trainer/Dockerfile, VARIANT=cpu
    localhost/nightshift/serving:<version>     images/serving/Dockerfile
    localhost/nightshift/airflow:<version>     images/airflow/Dockerfile

<version> is the project's version in pyproject.toml. The official base images (python:3.11-slim-bookworm,
apache/airflow) are not pulled: equivalents are built here, once, from a debootstrapped Debian bookworm
(localhost/debian:bookworm, made only when missing) and passed to the Dockerfiles as build arguments whose
defaults stay the official images. Every build keeps podman's layer cache, so a second run with nothing
changed only checks the cache.

The build machine's own package sources are used: apt inside the builds reaches the Debian mirror its apt
sources name; pip gets the machine's CA bundle (PIP_CERT or SSL_CERT_FILE) as the build secret `pip-ca`,
mounted only into the RUNs that call pip (never a layer); torch comes from a PEP 503 index this script serves
on 127.0.0.1 from the wheel directory PIP_FIND_LINKS names (when it holds the torch wheel), which sends every
other project to PyPI.

Stdlib only (no Airflow imports): runs with any Python >= 3.11.

One build at a time on a machine: a second `make images` (another checkout's test run, say) waits for the first
(a lock file in the temporary directory), then finds its layers cached. SIGTERM stops the podman build under way.

After every build succeeded, still under that lock, the images of superseded builds go (nightshift.image_retention:
an image that once carried one of these names, carries none now, and no container or child image holds; never the
unnamed layer cache of build stages): each rebuild would otherwise leave its predecessor's layers on disk for good.
`--keep-superseded` leaves them; `nightshift gc --images [--dry-run]` collects (or lists) them by hand.

usage: scripts/images.py [--only trainer,serving,airflow] [--cpu-shares N] [--keep-superseded]
"""

from __future__ import annotations

import argparse
import fcntl
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS_CONF = ROOT / "images" / "podman" / "containers.conf"
DEBIAN_IMAGE = "localhost/debian:bookworm"
PYTHON_IMAGE = "localhost/python:3.11-slim-bookworm"
AIRFLOW_BASE_IMAGE = "localhost/nightshift/airflow-base:{airflow}-python3.11"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
IMAGES = ("trainer", "serving", "airflow")
# Fixed, so that the TORCH_INDEX_URL build argument (part of podman's cache key) is the same on every run.
DEFAULT_INDEX_PORT = 18765
SECRET = "pip-ca"
# One build at a time on this machine (the torch index's port is fixed, and two builds of the same tags race).
LOCK_FILE = Path(tempfile.gettempdir()) / "nightshift-images.lock"
# Extra `podman build` flags for every build (--cpu-shares: the weight of the RUN containers' cgroup).
BUILD_FLAGS: list[str] = []


class ImagesError(RuntimeError):
    """Something the user has to fix; the message says what."""


class Stopped(Exception):
    """SIGTERM arrived: the podman build under way is killed (subprocess.run kills its child on an exception)."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


@contextmanager
def machine_lock() -> Iterator[None]:
    """Held for the whole build: another `make images` on this machine waits here, then finds its layers cached."""
    with LOCK_FILE.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            log(f"another image build holds {LOCK_FILE} (pid {holder}): waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield


def log(message: str) -> None:
    print(f"images: {message}", flush=True)


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, check=False, **kwargs)  # type: ignore[call-overload]


def podman(*args: str) -> list[str]:
    return ["podman", "--runtime", "runc", *args]


def check_tools() -> None:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool, path=path) is None]
    if missing:
        raise ImagesError(
            f"{' and '.join(missing)} not found: run `make setup` as root (it installs podman, buildah, runc "
            "and debootstrap), or install them with apt-get"
        )


def image_exists(name: str) -> bool:
    return run(podman("image", "exists", name)).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (NIGHTSHIFT_DEBIAN_MIRROR overrides it)."""
    if os.environ.get("NIGHTSHIFT_DEBIAN_MIRROR"):
        return os.environ["NIGHTSHIFT_DEBIAN_MIRROR"]
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for source in sources:
        for stanza in source.read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and "bookworm" in suites.group(1).split() and uris.group(1).rstrip("/").endswith(
                "/debian"
            ):
                return uris.group(1).rstrip("/")
    return DEFAULT_MIRROR


def ensure_debian_base() -> None:
    """localhost/debian:bookworm, debootstrapped once (about 200 MB, a few minutes); kept while it exists."""
    if image_exists(DEBIAN_IMAGE):
        return
    debootstrap = shutil.which("debootstrap", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if debootstrap is None:
        raise ImagesError(f"{DEBIAN_IMAGE} is missing and debootstrap is not installed: run `make setup` as root")
    if os.geteuid() != 0:
        raise ImagesError(f"{DEBIAN_IMAGE} is missing and debootstrap needs root: run `make images` as root once")
    mirror = debian_mirror()
    log(f"{DEBIAN_IMAGE} missing: debootstrap --variant=minbase bookworm from {mirror} (a few minutes)")
    with tempfile.TemporaryDirectory(prefix="nightshift-rootfs-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        result = run([debootstrap, "--variant=minbase", "bookworm", str(rootfs), mirror], capture_output=True)
        if result.returncode != 0:
            raise ImagesError(f"debootstrap from {mirror} failed:\n{(result.stdout + result.stderr)[-3000:]}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = run(podman("import", "-", DEBIAN_IMAGE), stdin=tar.stdout, capture_output=True)
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise ImagesError(f"importing the bookworm root file system failed: {imported.stderr.strip()}")


def ca_bundle() -> Path:
    for name in ("PIP_CERT", "SSL_CERT_FILE"):
        if os.environ.get(name):
            path = Path(os.environ[name])
            if not path.is_file():
                raise ImagesError(f"{name}={path} is not a file: point it at this machine's CA bundle")
            return path
    return Path("/etc/ssl/certs/ca-certificates.crt")


def torch_wheel(version: str) -> Path | None:
    """The CPU torch wheel for CPython 3.11 in PIP_FIND_LINKS's directories, if one is there."""
    for entry in os.environ.get("PIP_FIND_LINKS", "").split():
        folder = Path(entry.removeprefix("file://"))
        if folder.is_dir():
            for wheel in sorted(folder.glob(f"torch-{version}*-cp311-cp311-*linux*x86_64.whl")):
                if "+cu" not in wheel.name:
                    return wheel
    return None


def _handler(wheel: Path) -> type[BaseHTTPRequestHandler]:
    class Index(BaseHTTPRequestHandler):
        """/simple/torch/ lists the local wheel; every other project is redirected to PyPI's simple page."""

        def do_GET(self) -> None:
            parts = [urllib.parse.unquote(p) for p in self.path.split("?")[0].split("/") if p]
            if parts == ["simple", "torch"]:
                href = "/files/" + urllib.parse.quote(wheel.name)
                body = f'<a href="{html.escape(href)}">{html.escape(wheel.name)}</a>\n'.encode()
                self._send(200, "text/html", body)
            elif parts == ["files", wheel.name]:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(wheel.stat().st_size))
                self.end_headers()
                with wheel.open("rb") as f:
                    shutil.copyfileobj(f, self.wfile)
            elif len(parts) == 2 and parts[0] == "simple":
                self.send_response(302)
                self.send_header("Location", f"https://pypi.org/simple/{parts[1]}/")
                self.end_headers()
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Index


@contextmanager
def torch_index(version: str) -> Iterator[str | None]:
    """A PEP 503 index URL on 127.0.0.1 with the local torch wheel, or None (the Dockerfiles' default index)."""
    wheel = torch_wheel(version)
    if wheel is None:
        log(f"no torch=={version} CPU wheel in PIP_FIND_LINKS: torch comes from the PyTorch index")
        yield None
        return
    port = int(os.environ.get("NIGHTSHIFT_TORCH_INDEX_PORT", DEFAULT_INDEX_PORT))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), _handler(wheel))
    except OSError as exc:
        raise ImagesError(
            f"cannot serve the local torch index on 127.0.0.1:{port} ({exc}): if another `make images` runs, let it "
            "finish and run this again (its layers are then cached); else set NIGHTSHIFT_TORCH_INDEX_PORT to a free "
            "port (the index URL is part of the cache key of the layers that install torch: they are built again)"
        ) from exc
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/simple"
    finally:
        server.shutdown()
        server.server_close()


def git_commit() -> str:
    """What the images carry as NIGHTSHIFT_GIT_COMMIT: NIGHTSHIFT_GIT_COMMIT when set (a source tree without git),
    else HEAD plus a hash of uncommitted changes and untracked files (nightshift.ledger.git_version, the code
    version the tasks record): two different trees never share a value."""
    given = os.environ.get("NIGHTSHIFT_GIT_COMMIT", "").strip()
    if given:
        return given
    sys.path.insert(0, str(ROOT))
    try:
        from nightshift.errors import CodeVersionUnknown
        from nightshift.ledger import git_version
    finally:
        sys.path.remove(str(ROOT))
    try:
        return git_version(ROOT)
    except CodeVersionUnknown as err:
        raise ImagesError(str(err)) from err


def build(dockerfile: str, tag: str, args: dict[str, str], *, secret: Path | None) -> None:
    """`podman build` from the repository root; `secret`: the CA bundle for the RUNs that call pip, if any."""
    cmd = podman(
        # docker format: the OCI format drops SHELL (the Dockerfiles run RUN under bash -o pipefail).
        "build", "--format", "docker", "--network", "host", "--layers", "-f", dockerfile, "-t", tag, *BUILD_FLAGS,
    )
    if secret is not None:
        cmd += ["--secret", f"id={SECRET},src={secret}", "--build-arg", f"PIP_CERT=/run/secrets/{SECRET}"]
    ignore = ROOT / (dockerfile + ".dockerignore")
    if ignore.exists():
        cmd += ["--ignorefile", str(ignore)]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    started = time.monotonic()
    log(f"building {tag} from {dockerfile}")
    result = run([*cmd, "."], cwd=ROOT)
    if result.returncode != 0:
        raise ImagesError(f"building {tag} from {dockerfile} failed (exit {result.returncode}; podman's output above)")
    commit = args.get("NIGHTSHIFT_GIT_COMMIT")
    if commit is not None and image_env(tag).get("NIGHTSHIFT_GIT_COMMIT") != commit:
        try:
            restamp(tag, commit)
        except ImagesError:
            # The tag is on an image that carries another commit: no image may claim code it does not hold.
            run(podman("untag", tag), capture_output=True)
            raise
    log(f"built {tag} in {time.monotonic() - started:.0f} s")


def image_env(tag: str) -> dict[str, str]:
    out = run(podman("image", "inspect", "--format", "{{json .Config.Env}}", tag), capture_output=True)
    if out.returncode != 0:
        raise ImagesError(f"podman image inspect {tag} failed: {out.stderr.strip()}")
    return dict(item.split("=", 1) for item in json.loads(out.stdout))


def restamp(tag: str, commit: str) -> None:
    """Podman 4.3 (buildah 1.28) keys the layer cache of ENV/ARG instructions on their unexpanded text, so a
    build with only a new NIGHTSHIFT_GIT_COMMIT reuses the old commit's last layers. Then one ENV layer with
    the commit written out (its text, hence its cache key, is the commit) goes on top of the built image."""
    log(f"{tag}: podman reused the layer of an earlier NIGHTSHIFT_GIT_COMMIT; setting {commit}")
    with tempfile.TemporaryDirectory(prefix="nightshift-restamp-") as empty:
        containerfile = Path(empty) / "Containerfile"
        containerfile.write_text(f"FROM {tag}\nENV NIGHTSHIFT_GIT_COMMIT={commit}\n")
        result = run(podman("build", "--format", "docker", "--layers", "-f", str(containerfile), "-t", tag, empty),
                     capture_output=True)
    if result.returncode != 0 or image_env(tag).get("NIGHTSHIFT_GIT_COMMIT") != commit:
        raise ImagesError(f"could not set NIGHTSHIFT_GIT_COMMIT={commit} on {tag}: {result.stderr.strip()[-2000:]}")


def remove_superseded() -> None:
    """Remove the images of superseded builds (nightshift.image_retention), under the machine lock the caller holds.
    A failure is said and leaves the build's result as it is: the images built are fine."""
    sys.path.insert(0, str(ROOT))
    try:
        from nightshift.image_retention import ImageGcFailed, collect
    finally:
        sys.path.remove(str(ROOT))
    try:
        result = collect(lambda args: run(podman(*args), capture_output=True), dry_run=False)
    except ImageGcFailed as err:
        print(f"images: warning: superseded images were not all removed: {err}", file=sys.stderr)
        return
    for entry in result["remove"]:
        log(f"removed {entry['what']} ({entry['size'] / 1e6:,.0f} MB): {entry['reason']}")
    for entry in result["keep"]:
        if not entry["names"]:
            log(f"kept {entry['what']}: {entry['reason']}")


def size(tag: str) -> str:
    out = run(podman("image", "inspect", "--format", "{{.Size}}", tag), capture_output=True)
    return f"{int(out.stdout.strip()) / 1e6:,.0f} MB" if out.returncode == 0 else "?"


def project_pins() -> tuple[str, dict[str, str]]:
    """The project's version and the tested set the images install: constraints.txt's pins (pyproject.toml
    declares ranges), names lower-cased, a local version label (`+cpu`) left out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip().split("+", 1)[0]
    return project["version"], pins


def tags(version: str) -> dict[str, str]:
    return {
        "trainer": "localhost/nightshift/trainer:cpu",
        "serving": f"localhost/nightshift/serving:{version}",
        "airflow": f"localhost/nightshift/airflow:{version}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(IMAGES), help="comma-separated subset of: " + ", ".join(IMAGES))
    parser.add_argument("--cpu-shares", type=int, metavar="N",
                        help="the CPU weight of the builds' RUN containers (podman build --cpu-shares; default 1024): "
                             "lower lets other work on the machine go first")
    parser.add_argument("--keep-superseded", action="store_true",
                        help="keep the images of earlier builds that these builds superseded (by default they go "
                             "once every build succeeded: nightshift.image_retention)")
    options = parser.parse_args(argv)
    if options.cpu_shares is not None:
        if options.cpu_shares < 2:
            parser.error(f"--cpu-shares must be >= 2, got {options.cpu_shares}")
        BUILD_FLAGS[:] = ["--cpu-shares", str(options.cpu_shares)]
    wanted = [name.strip() for name in options.only.split(",") if name.strip()]
    unknown = set(wanted) - set(IMAGES)
    if unknown:
        parser.error(f"unknown image(s) {', '.join(sorted(unknown))}: choose from {', '.join(IMAGES)}")

    os.environ.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    version, pins = project_pins()
    names = tags(version)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _stop)
    try:
        return _build_all(wanted, names, pins, started, prune=not options.keep_superseded)
    except Stopped as stopped:
        print(f"images: stopped by {stopped} after {time.monotonic() - started:.0f} s", file=sys.stderr)
        return 128 + signal.SIGTERM


def _build_all(wanted: list[str], names: dict[str, str], pins: dict[str, str], started: float, *,
               prune: bool = True) -> int:
    commit = ""
    try:
        check_tools()
        secret = ca_bundle()
        commit = git_commit()
        with machine_lock():
            ensure_debian_base()
            build("images/local/python/Dockerfile", PYTHON_IMAGE, {"DEBIAN_IMAGE": DEBIAN_IMAGE}, secret=None)
            with torch_index(pins["torch"]) if {"trainer", "serving"} & set(wanted) else nullcontext() as index:
                torch = {"TORCH_INDEX_URL": index} if index else {}
                common = {"NIGHTSHIFT_GIT_COMMIT": commit}
                if "trainer" in wanted:
                    build("images/trainer/Dockerfile", names["trainer"],
                          {"VARIANT": "cpu", "PYTHON_IMAGE": PYTHON_IMAGE, **torch, **common}, secret=secret)
                if "serving" in wanted:
                    build("images/serving/Dockerfile", names["serving"],
                          {"PYTHON_IMAGE": PYTHON_IMAGE, **torch, **common}, secret=secret)
            if "airflow" in wanted:
                base = AIRFLOW_BASE_IMAGE.format(airflow=pins["apache-airflow"])
                build("images/local/airflow/Dockerfile", base,
                      {"PYTHON_IMAGE": PYTHON_IMAGE}, secret=secret)
                build("images/airflow/Dockerfile", names["airflow"], {"AIRFLOW_IMAGE": base, **common},
                      secret=secret)
            if prune:
                remove_superseded()
    except ImagesError as exc:
        print(f"images: error: {exc}", file=sys.stderr)
        return 1
    log(f"done in {time.monotonic() - started:.0f} s (NIGHTSHIFT_GIT_COMMIT={commit})")
    for name in wanted:
        print(f"{names[name]}  {size(names[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
