"""The `nightshift` command: every step of the DAG as a subcommand.

Results go to stdout as JSON; errors go to stderr as one line a person can act on.
Each step module exposes `add_parser(subparsers)`; the subparser's `func` returns a JSON-able
result (printed) or an int exit code. Subcommands from outside this package (`plan`, which lives above the
DAGs, or a third party's) are `add_parser` functions named in the `nightshift.commands` entry-point group:
this module finds them there and never imports a layer above it by name.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from nightshift.errors import NightshiftError

# Modules that contribute subcommands, imported only when the parser is built.
COMMAND_MODULES: tuple[str, ...] = (
    "nightshift.data.cli",
    "nightshift.train.cli",
    "nightshift.serving_cli",
    "nightshift.mpijob_local.cli",
    "nightshift.search.cli",
    "nightshift.events",
    "nightshift.stream.cli",
    "nightshift.pipelines.cli",
    "nightshift.gc",
    "nightshift.doctor",
)
# Subcommands that use MLflow: main configures it (nightshift.tracking.configure) before they run. `train`
# configures it itself, in rank 0 only.
MLFLOW_COMMANDS = frozenset({"evaluate", "register", "deploy", "search", "score-stream", "gc"})


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse already exits 2 on usage errors; keep its one-line form.
        self.exit(2, f"nightshift: error: {message}\n")


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (argparse's message names the flag it came with)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


# The entry-point group of subcommands defined outside this package; each names an `add_parser(subparsers)`.
# This project's own (`plan`) are declared in pyproject.toml's [project.entry-points."nightshift.commands"].
COMMAND_GROUP = "nightshift.commands"


def command_entry_points() -> list[EntryPoint]:
    """The `nightshift.commands` entry points of every installed distribution, sorted by name. This project's
    own come from its installed metadata: after pyproject.toml changes, `make setup` reinstalls it."""
    return sorted(entry_points(group=COMMAND_GROUP), key=lambda point: point.name)


def _where(point: EntryPoint) -> str:
    return f"distribution {point.dist.name}" if point.dist is not None else "an unknown distribution"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nightshift", description=__doc__.splitlines()[0] if __doc__ else None)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    for point in command_entry_points():
        try:
            add_parser = point.load()
        except (ImportError, AttributeError) as err:  # one broken plugin leaves the other subcommands usable
            print(f"nightshift: subcommand {point.name!r} left out: cannot load {point.value} ({_where(point)}): "
                  f"{err}; reinstall the distribution that declares it (pip install -e . for this checkout)",
                  file=sys.stderr)
            continue
        try:
            add_parser(subparsers)
        except argparse.ArgumentError as err:  # a name another subcommand has
            parser.error(f"the {COMMAND_GROUP} entry point {point.name!r} ({point.value}, {_where(point)}): "
                         f"{err.message}; rename it in that distribution")
    return parser


def emit(result: Any) -> None:
    """Print a command's result as JSON on stdout."""
    json.dump(result, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    from nightshift.settings import no_telemetry

    no_telemetry()
    try:
        parser = build_parser()  # reads the registries (NIGHTSHIFT_PLUGINS) for choices such as deploy --target
    except NightshiftError as err:
        print(f"nightshift: {err}", file=sys.stderr)
        return err.exit_code
    args = parser.parse_args(argv)
    try:
        if args.command in MLFLOW_COMMANDS:
            from nightshift.tracking import configure

            configure()
        result = args.func(args)
    except NightshiftError as err:
        print(f"nightshift {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    if isinstance(result, int):
        return result
    if result is not None:
        emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
