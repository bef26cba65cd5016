"""Name → factory registries, so a user plugs in a model or dataset without editing the trainer.

A name is either one registered with `@register(...)` (the demo's, or a user's module imported
through `NIGHTSHIFT_PLUGINS`), or an import path `package.module:factory`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Generic, TypeVar

from nightshift.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """Factories by name, with `module:attr` import paths as the escape hatch."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorate(factory: Callable[..., T]) -> Callable[..., T]:
            self._factories[name] = factory
            return factory

        return decorate

    def names(self) -> list[str]:
        _import_user_plugins()
        return sorted(self._factories)

    def get(self, name: str) -> Callable[..., T]:
        _import_user_plugins()
        if name in self._factories:
            return self._factories[name]
        if ":" in name:
            module_name, _, attr = name.partition(":")
            try:
                factory = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as err:
                raise UsageError(f"cannot import {self.kind} {name!r}: {err}") from err
            return factory
        known = ", ".join(sorted(self._factories)) or "none"
        raise UsageError(
            f"unknown {self.kind} {name!r}; known: {known} "
            f"(or give an import path 'package.module:factory')"
        )


def _import_user_plugins() -> None:
    """Import the comma-separated modules in NIGHTSHIFT_PLUGINS, which register their factories."""
    for module_name in filter(None, os.environ.get("NIGHTSHIFT_PLUGINS", "").split(",")):
        try:
            importlib.import_module(module_name.strip())
        except ImportError as err:
            raise UsageError(f"NIGHTSHIFT_PLUGINS names {module_name!r}, which cannot be imported: {err}") from err
