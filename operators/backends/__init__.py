"""Training backends by name: where `HorovodKubernetesOperator` runs a Horovod job.

One module per backend, each a `TrainingBackend` (operators.backends.base):

| name | module | runs the job |
|---|---|---|
| `local` | `operators.backends.local` | horovodrun on the Airflow worker's machine |
| `kubernetes` | `operators.backends.kubernetes` | an MPIJob on a cluster (the MPI Operator) |
| `hosts` | `operators.backends.hosts` | the MPIJob `kubernetes` would submit, on emulated hosts (run-mpijob) |

plus `auto` (kubernetes when the `kubernetes_conn_id` connection exists, else local). A third party adds one
without editing the project: an entry point in the group `nightshift.training_backends`
(`name = "package.module:Class"`), or a module named in NIGHTSHIFT_PLUGINS that calls
`register_backend(name, Class)` (or `register_backend(name, "package.module:Class")`). The DAG's `backend`
Param, the operator's check of `ClusterConfig.backend` and `plan` take their choices from `backend_choices()`.

`backend_names()`, `backend_choices()` and `backend_help()` are cheap: a DAG file calls them at parse time. They
import neither Airflow nor a backend's module (only NIGHTSHIFT_PLUGINS's modules, and read the installed entry
points).

A backend is known by the one name it is registered as: `create_backend(name, run)` makes the instance and sets
its `name`, which the operator writes into the task's result and which a deferral's resume, a failed deferral
and the elastic refusal go by (operators.backends.base describes the whole contract).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nightshift.errors import UsageError
from nightshift.plugins import Registry

if TYPE_CHECKING:
    from operators.backends.base import BackendRun, TrainingBackend

ENTRY_POINT_GROUP = "nightshift.training_backends"
AUTO = "auto"
BUILTIN_BACKENDS = {
    "local": "operators.backends.local:LocalBackend",
    "kubernetes": "operators.backends.kubernetes:KubernetesBackend",
    "hosts": "operators.backends.hosts:HostsBackend",
}
# What each built-in runs, for the forms that list the choices (a plugin's is "a plugin's").
BUILTIN_SUMMARIES = {
    "local": "horovodrun on the Airflow worker's machine",
    "kubernetes": "an MPIJob on the cluster (the MPI Operator)",
    "hosts": "the MPIJob kubernetes would submit, on emulated hosts of the Airflow worker's machine",
}
AUTO_SUMMARY = "kubernetes when the task's Kubernetes connection (kubernetes_default) exists, else local"

log = logging.getLogger(__name__)

BACKENDS: Registry[TrainingBackend] = Registry("training backend", builtins=BUILTIN_BACKENDS,
                                               entry_point_group=ENTRY_POINT_GROUP, strict=True,
                                               reserved=frozenset({AUTO}))


class UnknownBackend(UsageError, ValueError):
    """A backend name no built-in, entry point or NIGHTSHIFT_PLUGINS module registered."""


def register_backend(name: str, backend: type[TrainingBackend] | str) -> None:
    """Make `backend` (a TrainingBackend subclass, or its import path "package.module:Class") the backend
    `name`; call it from a module named in NIGHTSHIFT_PLUGINS."""
    BACKENDS.add(name, backend)  # a class is its own factory; a built-in's name and "auto" are refused


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, sorted (no "auto")."""
    return tuple(BACKENDS.names())


def backend_choices() -> tuple[str, ...]:
    """What a user may choose: every backend name, and "auto"."""
    return (*backend_names(), AUTO)


def check_backend(name: object) -> str:
    """`name` if it is a backend name or "auto"; else UnknownBackend listing the choices."""
    if isinstance(name, str) and name.strip() in (*BUILTIN_BACKENDS, AUTO):  # no plugin needs importing for these
        return name.strip()
    choices = backend_choices()
    if not isinstance(name, str) or name.strip() not in choices:
        raise UnknownBackend(f"unknown training backend {name!r}; choose one of {', '.join(choices)} (a new one "
                             f"is registered by an entry point in {ENTRY_POINT_GROUP} or by a NIGHTSHIFT_PLUGINS "
                             f"module calling operators.backends.register_backend)")
    return name.strip()


def backend_help() -> str:
    """What each of `backend_choices()` runs, in one line (a DAG Param's description)."""
    described = [f"{name}: {BUILTIN_SUMMARIES.get(name, 'a plugin backend (operators.backends)')}"
                 for name in backend_names()]
    return "; ".join([*described, f"{AUTO}: {AUTO_SUMMARY}"]) + "."


def elastic_backends() -> tuple[str, ...]:
    """The backends that run elastic jobs (`TrainingBackend.supports_elastic`), sorted; imports each backend's
    module. A built-in that cannot be imported raises (the installation is broken); a plugin that cannot be
    loaded is left out, with a warning naming it and why."""
    names = []
    for name in backend_names():
        try:
            cls = backend_class(name)
        except Exception as err:  # a plugin's module may fail with anything at import
            if name in BUILTIN_BACKENDS:
                raise
            log.warning("training backend %r left out of the elastic ones: %s: %s", name, type(err).__name__, err)
            continue
        if cls.supports_elastic:
            names.append(name)
    return tuple(names)


def backend_class(name: str) -> type[TrainingBackend]:
    """The TrainingBackend class registered as `name` (imports its module)."""
    from operators.backends.base import TrainingBackend

    check_backend(name)
    if name == AUTO:
        raise UnknownBackend(f"{AUTO!r} is resolved to a backend by the operator (resolve_backend) first")
    try:
        cls = BACKENDS.get(name)
    except UsageError as err:
        raise UnknownBackend(str(err)) from err
    if not (isinstance(cls, type) and issubclass(cls, TrainingBackend)):
        raise UnknownBackend(f"training backend {name!r} is {cls!r}, not a subclass of "
                             f"operators.backends.base.TrainingBackend")
    return cls


def create_backend(name: str, run: BackendRun) -> TrainingBackend:
    """This try's instance of the backend registered as `name`, given `run`, known as `name` (its `name` set
    here, whatever its class says). UnknownBackend, naming the plugin, when it cannot be made."""
    cls = backend_class(name)
    where = f"{cls.__module__}.{cls.__qualname__}"
    try:
        backend = cls.__new__(cls)
    except TypeError as err:  # abstract methods left out
        raise UnknownBackend(f"training backend {name!r} ({where}) cannot be made: {err}; a backend implements "
                             f"submit, wait, cancel and cleanup, and takes the BackendRun (operators.backends."
                             f"base) as its one argument") from err
    try:
        backend.name = name  # before __init__: a constructor may use it
    except AttributeError as err:  # a read-only `name` (a property) of the class's own
        raise UnknownBackend(f"training backend {name!r} ({where}) has a read-only `name`; leave `name` to the "
                             f"registry, which sets it to the registered name") from err
    try:
        backend.__init__(run)  # type: ignore[misc]
    except TypeError as err:  # a constructor of another shape
        raise UnknownBackend(f"training backend {name!r} ({where}) cannot be made: {err}; a backend takes the "
                             f"BackendRun (operators.backends.base) as its one argument") from err
    backend.name = name  # the registered name, whatever a constructor set
    return backend


__all__ = ["AUTO", "BACKENDS", "ENTRY_POINT_GROUP", "UnknownBackend", "backend_choices", "backend_class",
           "backend_help", "backend_names", "check_backend", "create_backend", "elastic_backends",
           "register_backend"]
