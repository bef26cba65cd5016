"""`nightshift run-mpijob MANIFEST [--volume CLAIM=DIR]... [--runtime host|podman] [--link-rate R] [--link-delay MS]
[--timeout S] [--chaos SCRIPT]`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError


def _claim(text: str) -> tuple[str, str]:
    claim, sep, directory = text.partition("=")
    if not sep or not claim or not directory:
        raise argparse.ArgumentTypeError(f"--volume {text!r} must look like CLAIM=DIR")
    return claim, str(Path(directory).resolve())


def _service(text: str) -> Any:
    from nightshift.mpijob_local.runner import Service

    target, sep, command = text.partition("=")
    host, colon, port = target.rpartition(":")
    if not sep or not colon or not port.isdigit() or not command.strip():
        raise argparse.ArgumentTypeError(f"--service {text!r} must look like HOST:PORT=COMMAND")
    try:
        return Service(host=host, port=int(port), argv=tuple(shlex.split(command)))
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run-mpijob", help="run an MPIJob manifest on this machine across emulated hosts (root)",
        description="Run an MPIJob (kubeflow.org/v2beta1) here as the MPI Operator would: one network, UTS and "
                    "mount namespace per pod on a private bridge, sshd in the workers, /etc/mpi/hostfile in "
                    "the launcher. Pod logs go to stdout prefixed with the pod name; the exit status is the "
                    "launcher's.")
    parser.add_argument("manifest", help="the MPIJob as YAML (e.g. from `nightshift plan`); - for stdin")
    parser.add_argument("--volume", dest="volumes", type=_claim, action="append", default=[],
                        metavar="CLAIM=DIR", help="directory of this machine that PersistentVolumeClaim CLAIM is")
    parser.add_argument("--link-rate", help="tc rate of every host's link, both directions (e.g. 1gbit)")
    parser.add_argument("--link-delay", type=float, metavar="MS", help="one-way delay into every host, in ms")
    parser.add_argument("--link-loss", type=float, metavar="PCT", help="packet loss into every host, in percent")
    parser.add_argument("--timeout", type=float, metavar="S", help="stop the job after S seconds (exit 124)")
    parser.add_argument("--ready-timeout", type=float, default=120.0, metavar="S",
                        help="how long workers and services may take to accept connections (120)")
    parser.add_argument("--service", dest="services", type=_service, action="append", default=[],
                        metavar="HOST:PORT=COMMAND",
                        help="run COMMAND on a host of its own named HOST, on the job's network, before the "
                             "workers; ready when PORT accepts connections (e.g. an MLflow server)")
    parser.add_argument("--runtime", choices=("host", "podman"), default="host",
                        help="host (default): each pod runs its command from this machine's disk; podman: each "
                             "pod is a container of its template's image inside its emulated host")
    parser.add_argument("--chaos", metavar="SCRIPT",
                        help="worker failures at set times from the launcher's start, e.g. 'kill worker-1 at 30s; "
                             "restore worker-1 at 60s' (actions: kill, restore, down, up; pods: worker-N or the "
                             "pod's name)")
    parser.add_argument("--chaos-after", metavar="REGEX",
                        help="start the --chaos script's clock at the first line of the launcher's log matching "
                             "REGEX (e.g. the trainer's first step), not at the launcher's start: the failures then "
                             "follow the job's progress, however slowly it started")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="give each worker host a core of its own, as a cluster gives each host its own: worker "
                             "i's processes are pinned to the i-th core this process may use (modulo their count); "
                             "the launcher and services are not pinned (host runtime)")
    parser.add_argument("--containers-conf", metavar="PATH",
                        help="containers.conf for podman (default: $NIGHTSHIFT_CONTAINERS_CONF, $CONTAINERS_CONF, "
                             "else the repository's images/podman/containers.conf)")
    parser.add_argument("--oci-runtime", metavar="NAME",
                        help="podman --runtime NAME (e.g. runc; default: $NIGHTSHIFT_OCI_RUNTIME, else "
                             "containers.conf's)")
    parser.set_defaults(func=_run)


def _load(path: str) -> Any:
    import yaml

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror}") from err
    documents = [d for d in yaml.safe_load_all(text) if d]
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == "MPIJob"]
    if len(jobs) != 1:
        raise UsageError(f"{path} must hold exactly one MPIJob, found {len(jobs)}")
    return jobs[0]


def _run(args: argparse.Namespace) -> int:
    from nightshift.mpijob_local.network import LinkShape
    from nightshift.mpijob_local.podman import PodmanSettings
    from nightshift.mpijob_local.runner import RunOptions, run_mpijob

    options = RunOptions(claims=dict(args.volumes),
                         link=LinkShape(rate=args.link_rate, delay_ms=args.link_delay, loss_pct=args.link_loss),
                         timeout_s=args.timeout, services=tuple(args.services), ready_timeout_s=args.ready_timeout,
                         runtime=args.runtime, chaos=args.chaos, chaos_after=args.chaos_after,
                         pin_cpus=args.pin_cpus,
                         podman=PodmanSettings.from_environment(args.containers_conf, args.oci_runtime))
    return run_mpijob(_load(args.manifest), options)
