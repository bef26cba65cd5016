"""Name → factory registries, so a user plugs in a model, dataset, training backend or deployment target
without editing the project.

A name is found, in this order, among:

- the ones registered in this process with `@registry.register(name)` or `registry.add(name, factory)`: the
  project's own, and a user's module imported through `NIGHTSHIFT_PLUGINS` (comma-separated module names);
- the registry's built-ins, given as `package.module:attr` paths and imported only when asked for by name
  (listing the names imports nothing);
- the registry's entry-point group, if it has one (`[project.entry-points."<group>"]` of an installed
  distribution, as MLflow's deployment plugins are found), likewise loaded only when asked for.

A registry without `strict` also takes an import path `package.module:factory` as a name.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, Generic, TypeVar

from nightshift.errors import UsageError

T = TypeVar("T")

PLUGINS_ENV = "NIGHTSHIFT_PLUGINS"


class Registry(Generic[T]):
    """Factories by name: registered ones, lazily imported built-ins, an entry-point group; `module:attr`
    import paths as the escape hatch (unless `strict`)."""

    def __init__(self, kind: str, *, builtins: Mapping[str, str] | None = None, entry_point_group: str | None = None,
                 strict: bool = False, reserved: frozenset[str] = frozenset()) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.strict = strict
        self.reserved = reserved  # names that are no entry of this registry (e.g. the backends' "auto")
        self._builtins: dict[str, str] = dict(builtins or {})
        self._factories: dict[str, Callable[..., T] | str] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorate(factory: Callable[..., T]) -> Callable[..., T]:
            self.add(name, factory)
            return factory

        return decorate

    def add(self, name: str, factory: Callable[..., T] | str) -> None:
        """Register `factory` (or its import path `package.module:attr`, imported when first asked for) as
        `name`; a later registration of the same name wins over an earlier one. A built-in's name or a reserved
        one is refused: a plugin never silently takes the place of what the project ships."""
        problem = self._name_problem(name)
        if problem:
            raise UsageError(problem)
        if isinstance(factory, str) and ":" not in factory:
            raise UsageError(f"{self.kind} {name!r}: {factory!r} is no import path; give 'package.module:attr' "
                             f"or the object itself")
        self._factories[name] = factory

    def _name_problem(self, name: object) -> str | None:
        """Why `name` cannot be registered (None: it can)."""
        if not isinstance(name, str) or not name.strip() or name != name.strip() or any(c.isspace() for c in name):
            return f"a {self.kind} name must be a non-empty string without spaces, got {name!r}"
        if name in self._builtins or name in self.reserved:
            what = "a built-in" if name in self._builtins else "reserved"
            return f"{self.kind} name {name!r} is {what}; register the plugin's under a name of its own"
        return None

    def _entry_points(self) -> dict[str, Any]:
        """The group's entry points whose names can be registered; the others are logged once and left out."""
        if not self.entry_point_group:
            return {}
        found = _entry_points(self.entry_point_group, tuple(sys.path))
        usable = {}
        for name, entry in found.items():
            problem = self._name_problem(name)
            if problem is None:
                usable[name] = entry
            else:
                _warn_once(f"entry point {entry.value!r} of group {self.entry_point_group} left out: {problem}")
        return usable

    def names(self) -> list[str]:
        """Every name, sorted, importing nothing but NIGHTSHIFT_PLUGINS's modules. A module there that cannot be
        imported is logged (naming it) and its names are missing: a DAG file listing the choices still parses,
        and a run that asks for a missing name is refused by get()."""
        try:
            import_user_plugins()
        except UsageError as err:
            _warn_once(str(err))
        found = set(self._builtins) | set(self._factories) | set(self._entry_points())
        return sorted(found)

    def get(self, name: str) -> Callable[..., T]:
        if name in self._builtins:  # what the project ships never depends on a plugin importing
            return _load(self.kind, name, self._builtins[name])
        import_user_plugins()
        where = self._factories.get(name)
        if where is None:
            entry = self._entry_points().get(name)
            if entry is not None:
                try:
                    loaded: Callable[..., T] = entry.load()
                    return loaded
                except Exception as err:
                    raise UsageError(f"cannot load {self.kind} {name!r} (entry point {entry.value!r} of group "
                                     f"{self.entry_point_group}): {err}") from err
        if where is None and ":" in name and not self.strict:
            where = name
        if where is None:
            hint = "" if self.strict else " (or give an import path 'package.module:factory')"
            raise UsageError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names()) or 'none'}{hint}")
        if isinstance(where, str):
            return _load(self.kind, name, where)
        return where


def _load(kind: str, name: str, path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        shown = repr(name) if name == path else f"{name!r} ({path})"
        raise UsageError(f"cannot import {kind} {shown}: {err}") from err


@lru_cache(maxsize=16)
def _entry_points(group: str, path: tuple[str, ...]) -> dict[str, Any]:
    """The group's entry points by name, for this sys.path (a scan of the installed distributions: cached)."""
    from importlib.metadata import entry_points

    return {entry.name: entry for entry in entry_points(group=group)}


def keyword_arguments(factory: Callable[..., Any], *, supplied: tuple[str, ...] = ()) -> list[str] | None:
    """The keyword arguments a user may give `factory` (a registered model's or dataset's), sorted: its named
    parameters but `self` and those its caller `supplied` itself (the trainer's input_shape and num_classes, a
    loader's data_dir, split and task). None when it takes any (a `**kwargs`) or has no signature to read."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return sorted(name for name, p in parameters.items() if p.kind in named and name not in (*supplied, "self"))


def import_user_plugins() -> None:
    """Import the comma-separated modules in NIGHTSHIFT_PLUGINS, which register their factories."""
    for module_name in filter(None, (name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(module_name)
        except Exception as err:  # whatever a plugin's import raises, the message names the plugin
            raise UsageError(f"{PLUGINS_ENV} names {module_name!r}, which cannot be imported: "
                             f"{type(err).__name__}: {err}") from err


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).warning("%s", message)
