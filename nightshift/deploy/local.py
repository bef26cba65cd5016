"""The `local` target: `mlflow models serve --env-manager local` on 127.0.0.1, switched blue/green.

The serving record `serving_dir()/<model>.json` says which version answers where (url, port, pid).
A new version starts beside the old one on a free port from its own local copy of the artifacts,
must answer `/ping` and a canary batch with known labels about as well as it was evaluated, and only
then do the record and the `@champion` alias switch and the old server stop. On any failure the new
server is stopped and nothing else changes.

A free port is only free when it is chosen: deployments of two models run at once (each holds only its
own model's lock), and either may start its server on the port the other chose a moment before. A server
counts as healthy only once the socket listening on its port is its own; when another process listens
there first (or the server exits because the address is in use), the server is stopped and started again
on another port, `PORT_TRIES` times at most.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nightshift import registry, settings, tracking
from nightshift.deploy.smoke import canary_batch, model_contract, post_json, smoke_test
from nightshift.errors import DeploymentFailed, UsageError
from nightshift.fsutil import atomic_write_json
from nightshift.netutil import free_port, listening_sockets, socket_inodes
from nightshift.served_model import RANGE_POLICY_ENV, check_range_policy, served_bounds

HOST = "127.0.0.1"
SERVERS = ("mlflow", "guarded")
PORT_TRIES = 5
# What uvicorn ("[Errno 98] ... address already in use") and gunicorn ("Connection in use") log when the
# port is taken, lower-cased.
_ADDRESS_IN_USE = ("address already in use", "[errno 98]", "connection in use")


class PortTaken(DeploymentFailed):
    """Another process listens on the port a model server was started on (the free port was taken meanwhile)."""


def record_path(model_name: str) -> Path:
    return settings.serving_dir() / f"{model_name}.json"


def read_record(model_name: str) -> dict[str, Any] | None:
    """The serving record of `model_name`, or None when nothing was deployed locally."""
    path = record_path(model_name)
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise DeploymentFailed(f"serving record {path} is corrupt ({err}); stop the server it names "
                               f"and delete the file") from err


def _write_record(model_name: str, record: dict[str, Any] | None) -> None:
    path = record_path(model_name)
    if record is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)


@contextlib.contextmanager
def _deploy_lock(model_name: str) -> Iterator[None]:
    """One deployment of a model at a time on this machine."""
    path = settings.serving_dir() / f".{model_name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise DeploymentFailed(f"another deployment of {model_name} is running (lock {path}); "
                                   f"wait for it to finish") from err
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    # `mlflow models serve` runs `uvicorn` from PATH: make it this interpreter's.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    env["DO_NOT_TRACK"] = "true"
    return env


def start_server(model_path: Path, port: int, log_path: Path, server: str = "mlflow",
                 range_policy: str = "accept") -> subprocess.Popen[bytes]:
    """Start a model server on 127.0.0.1:port in its own session (its PID leads the process group).

    `range_policy`: what the served model does with a value beyond its training range (widened): `accept`
    (answer and count) or `refuse` (a 400); nightshift.served_model.RANGE_POLICY_ENV in the server's environment.

    `server="mlflow"`: `mlflow models serve --env-manager local`, as is. `server="guarded"`: the same
    MLflow scoring app under uvicorn behind `nightshift.deploy.guard.RequestGuard` (415 without a
    Content-Type, 413 above the body limit, short error bodies; see that module for why).
    """
    env = _server_env()
    env[RANGE_POLICY_ENV] = check_range_policy(range_policy)
    if server == "mlflow":
        command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(model_path),
                   "--env-manager", "local", "-h", HOST, "-p", str(port), "--workers", "1"]
    elif server == "guarded":
        command = [sys.executable, "-m", "uvicorn", "--host", HOST, "--port", str(port), "--workers", "1",
                   "nightshift.deploy.asgi:app"]
        env["NIGHTSHIFT_SERVING_MODEL"] = str(model_path)
    else:
        raise UsageError(f"unknown model server {server!r}; use one of {', '.join(SERVERS)}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that exited: reap it
            return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _group_pids(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group `pgid` (the server and its uvicorn)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group `pgid` (the server and its uvicorn)."""
    _alive(pgid)  # reaps the session leader if it is our own exited child
    return bool(_group_pids(pgid))


def _is_model_server(pid: int, model_path: str | None = None) -> bool:
    """Whether `pid` is a model server (of the folder `model_path`, when given: a PID reused after a reboot may
    be another model's server)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False
    joined = b" ".join(cmdline)
    guarded = b"nightshift.deploy.asgi:app" in cmdline
    if not ((b"mlflow" in joined and b"serve" in cmdline) or guarded):
        return False
    if model_path is None:
        return True
    if guarded:  # its model folder is in its environment
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"NIGHTSHIFT_SERVING_MODEL=" + os.fsencode(model_path) in environ
    return os.fsencode(model_path) in cmdline


def stop_server(pid: int, timeout: float = 20.0, model_path: str | None = None) -> bool:
    """Stop the model server whose session leader is `pid` and its uvicorn child (TERM, then KILL).

    Returns once no process of its group is left (so its port is closed); False if it was not running.
    A PID that no longer belongs to an MLflow model server (reused by the OS), or, with `model_path`, to the
    server of that model folder, is left alone.
    """
    if not _alive(pid) or not _is_model_server(pid, model_path):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _group_alive(pid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for _ in range(50):
        if not _group_alive(pid):
            break
        time.sleep(0.1)
    return True


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return ""
    return " / ".join(line.strip() for line in text[-lines:])[-600:]


def _port_owner(port: int, pgid: int) -> str:
    """Who listens on `port`: "ours" (only process group `pgid`), "other" (another process too), "none"; or
    "unknown" where /proc/net/tcp cannot be read."""
    listening = listening_sockets(port)
    if listening is None:
        return "unknown"
    if not listening:
        return "none"
    return "ours" if listening <= socket_inodes(_group_pids(pgid)) else "other"


def _address_in_use(log_path: Path, offset: int) -> bool:
    """Whether the server's log, from `offset` (where this start's lines begin), says its port was in use."""
    try:
        with log_path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace").lower()
    except OSError:
        return False
    return any(sign in text for sign in _ADDRESS_IN_USE)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float, *,
                 port: int | None = None, log_offset: int = 0) -> None:
    """Wait until GET /ping answers 200; fail early when the server process exits.

    With `port`, the answer counts only once the socket listening on `port` is the server's own (another
    process's server would answer /ping too); PortTaken when another process listens there, or when the
    server exits saying the address is in use (its log from `log_offset`).
    """
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if port is not None and _address_in_use(log_path, log_offset):
                raise PortTaken(f"model server could not bind port {port}: address already in use "
                                f"(log {log_path}: {_log_tail(log_path)})")
            raise DeploymentFailed(f"model server exited with code {proc.returncode} before answering "
                                   f"(log {log_path}: {_log_tail(log_path)})")
        owner = "unknown" if port is None else _port_owner(port, proc.pid)
        if owner == "other":
            raise PortTaken(f"another process listens on port {port}, chosen for this model server")
        if owner != "none":  # not bound yet: nothing of ours can answer
            try:
                if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
        time.sleep(0.25)
    raise DeploymentFailed(f"model server at {url} did not answer /ping within {timeout:.0f}s "
                           f"(log {log_path}: {_log_tail(log_path)})")


def is_healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/ping", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _still_serving(record: dict[str, Any]) -> bool:
    """Whether the server `record` names still answers on its port itself. It may have died and left its
    port to whatever started next, another model's server included, which answers /ping too: only a
    listener of the recorded process group counts (where /proc/net/tcp can be read)."""
    try:
        pgid, port = int(record["pid"]), int(record["port"])
    except (KeyError, TypeError, ValueError):
        return False  # a record that does not say which server: deploy again
    return _port_owner(port, pgid) in ("ours", "unknown") and is_healthy(str(record["url"]))


def _download(model_name: str, version: str) -> Path:
    """A local copy of the version's artifacts under serving_dir()/models (fresh on every call)."""
    import mlflow.artifacts

    root = settings.serving_dir() / "models"
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{model_name}-v{version}."))
    try:
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_name}/{version}",
                                            dst_path=str(staging),
                                            tracking_uri=tracking.tracking_uri())
    except Exception as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise DeploymentFailed(f"downloading {model_name} v{version} failed ({type(err).__name__}: {err}); "
                               f"check the artifact store") from err
    return staging


def deploy_local(model_name: str, *, data_dir: str | Path, version: str | None = None,
                 alias: str = registry.CHALLENGER, canary_rows: int = 256, tolerance: float = 0.05,
                 startup_timeout: float = 180.0, server: str = "mlflow",
                 range_policy: str = "accept", lock_held: bool = False) -> dict[str, Any]:
    """Serve `model_name` `version` (default: the version `@alias`) locally, blue/green, and promote it.

    `range_policy` (accept | refuse) is the served model's answer to values beyond its training range; the
    canary batch holds only rows the server takes under it (a smoke test never fails for a row's range).

    Returns {"target": "local", "status": "promoted" | "already_serving", "model_name", "version",
    "url", "port", "pid", "model_path", "smoke": {...}, "previous": {"version", "pid", "stopped"} | None}.
    Raises DeploymentFailed when the new server does not start, answer, or pass the smoke test; the old
    server, the record and `@champion` are then untouched. `lock_held`: the caller holds the model's deploy lock
    (restore_local, which decides under it).
    """
    check_range_policy(range_policy)
    with contextlib.nullcontext() if lock_held else _deploy_lock(model_name):
        if version is None:
            selected = registry.version_by_alias(model_name, alias)
            if selected is None:
                raise DeploymentFailed(f"{model_name}@{alias} does not exist; run `nightshift register` first "
                                       f"or pass --version")
            version = str(selected.version)
        else:
            selected = registry.get_version(model_name, version)
        version = str(version)
        old = read_record(model_name)
        if old and str(old.get("version")) == version and _still_serving(old):
            registry.set_alias(model_name, registry.CHAMPION, version)
            return {"target": "local", "status": "already_serving", "model_name": model_name,
                    "version": version, "url": old["url"], "port": old["port"], "pid": old["pid"],
                    "model_path": old.get("model_path"), "smoke": None, "previous": None}

        expected = registry.evaluated_accuracy(selected)
        staging = _download(model_name, version)
        try:
            contract = model_contract(staging)  # a tabular model's columns, label and task
            frame, labels = canary_batch(data_dir, canary_rows, contract=contract,
                                         within=served_bounds(staging, range_policy))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            proc, port, model_path, log_path = _start_on_a_free_port(model_name, version, staging, server,
                                                                     startup_timeout, range_policy)
        except DeploymentFailed as err:
            raise DeploymentFailed(f"{model_name} v{version} not deployed: {err}; {_serving_now(old)}") from err
        url = f"http://{HOST}:{port}"
        try:
            smoke = smoke_test(url, frame, labels, expected_accuracy=expected, tolerance=tolerance,
                               task=contract.task)
            record = {"model_name": model_name, "version": version, "url": url, "port": port, "server": server,
                      "pid": proc.pid, "model_path": str(model_path), "log_path": str(log_path),
                      "started_at": datetime.now(UTC).isoformat(timespec="seconds")}
            _write_record(model_name, record)
            try:
                registry.set_alias(model_name, registry.CHAMPION, version)
            except Exception:
                _write_record(model_name, old)
                raise
        except BaseException as err:
            stop_server(proc.pid)
            shutil.rmtree(model_path, ignore_errors=True)
            if isinstance(err, DeploymentFailed):
                raise DeploymentFailed(f"{model_name} v{version} not deployed: {err}; "
                                       f"{_serving_now(old)}") from err
            raise
        previous = None
        if old:
            stopped = stop_server(int(old["pid"]), model_path=old.get("model_path"))
            if old.get("model_path") and Path(old["model_path"]) != model_path:
                shutil.rmtree(old["model_path"], ignore_errors=True)
            previous = {"version": str(old.get("version")), "pid": old.get("pid"), "stopped": stopped}
        return {"target": "local", "status": "promoted", "model_name": model_name, "version": version,
                "url": url, "port": port, "pid": proc.pid, "model_path": str(model_path),
                "smoke": smoke, "previous": previous}


def _alias_version(model_name: str) -> str | None:
    champion = registry.version_by_alias(model_name, registry.CHAMPION)
    return None if champion is None else str(champion.version)


def restore_local(model_name: str, *, data_dir: str | Path, **options: Any) -> dict[str, Any] | None:
    """Serve `@champion` again where its recorded server no longer answers: killed, OOM-killed, or gone with a
    reboot of the machine (a night that registers nothing deploys nothing, and the local target has no supervisor
    that would restart it). None when there is nothing to do: no serving record (never served here, or stopped on
    purpose with `nightshift deploy --stop`), no champion, or the recorded server is @champion's and answers.
    Decided with the model's deploy lock held, so that a deployment running meanwhile is never undone.

    The version was judged when it was first deployed (its canary accuracy); a restart serves the same
    artifacts, so it checks that the server answers every canary row of `data_dir` well-formed, not the accuracy on
    tonight's data (a night of drift or label noise would refuse the champion's own restart). Otherwise as
    deploy_local: the record and `@champion` move only once the new server answers; DeploymentFailed says why not.
    Returns deploy_local's result with status "restarted", `reason`, and `previous` (the record it replaced)."""
    check_range_policy(options.get("range_policy", "accept"))
    old = read_record(model_name)
    if not old or (_still_serving(old) and str(old.get("version")) == _alias_version(model_name)):
        return None  # the common case, without the lock: a deployment running meanwhile is not held up
    with _deploy_lock(model_name):
        old = read_record(model_name)
        if not old:
            return None
        version = _alias_version(model_name)
        if version is None:
            return None
        if str(old.get("version")) == version:
            if _still_serving(old):
                return None
            reason = f"v{version}'s server no longer answered"
        else:  # a deployment stopped between writing the record and moving the alias
            reason = f"the record named v{old.get('version')}, not @champion v{version}"
        result = deploy_local(model_name, data_dir=data_dir, version=version, alias=registry.CHAMPION,
                              lock_held=True, **{**options, "tolerance": 1.0})
    return {**result, "status": "restarted", "reason": reason,
            "previous": {"version": old.get("version"), "url": old.get("url"), "pid": old.get("pid")}}


def _start_on_a_free_port(model_name: str, version: str, staging: Path, server: str, startup_timeout: float,
                          range_policy: str = "accept") -> tuple[subprocess.Popen[bytes], int, Path, Path]:
    """Serve the downloaded `staging` on a free port until /ping answers from it: (process, port, model
    path, log path). A port another process took first is given up, its server stopped and its model
    folder renamed for the next port, `PORT_TRIES` times at most. On any failure nothing is left behind:
    no server, no model folder (the logs stay, and are named in the error)."""
    model_path = staging
    taken: list[str] = []
    try:
        for _ in range(PORT_TRIES):
            port = free_port()
            model_path = model_path.rename(staging.with_name(f"{model_name}-v{version}-{port}"))
            log_path = settings.serving_dir() / "logs" / f"{model_name}-v{version}-{port}.log"
            offset = log_path.stat().st_size if log_path.exists() else 0
            proc = start_server(model_path, port, log_path, server, range_policy)
            try:
                wait_healthy(f"http://{HOST}:{port}", proc, log_path, startup_timeout, port=port,
                             log_offset=offset)
            except PortTaken as err:
                stop_server(proc.pid)
                taken.append(str(err))
                continue
            except BaseException:
                stop_server(proc.pid)
                raise
            return proc, port, model_path, log_path
    except BaseException:
        shutil.rmtree(model_path, ignore_errors=True)
        raise
    shutil.rmtree(model_path, ignore_errors=True)
    raise DeploymentFailed(f"each of {PORT_TRIES} free ports was taken by another process before the model "
                           f"server bound it ({'; '.join(taken)}); other servers are starting on this host "
                           f"faster than ports are chosen: deploy again")


def _serving_now(old: dict[str, Any] | None) -> str:
    if not old:
        return "nothing was serving before and the @champion alias did not move"
    return f"v{old.get('version')} keeps serving at {old.get('url')} and stays @champion"


def stop_local(model_name: str) -> dict[str, Any]:
    """Stop the local server of `model_name` and remove its record (the aliases are left as they are)."""
    with _deploy_lock(model_name):
        old = read_record(model_name)
        if not old:
            return {"model_name": model_name, "stopped": False, "version": None}
        stopped = stop_server(int(old["pid"]))
        _write_record(model_name, None)
        return {"model_name": model_name, "stopped": stopped, "version": str(old.get("version"))}


def predict(url: str, frame: Any, timeout: float = 30.0) -> Any:
    """POST a raw feature table to a model server; return the parsed predictions."""
    return post_json(url, {"dataframe_split": {"columns": list(frame.columns),
                                               "data": frame.to_numpy().tolist()}}, timeout=timeout)
