"""Subcommands from outside the `nightshift` package come from the `nightshift.commands` entry-point group.

`nightshift plan` lives above the DAGs (nightshift_plan/): the CLI finds it by its entry point, never by name. A
distribution of one's own (here: one written to a folder on sys.path, as pip would install it) adds a subcommand
the same way, without editing this project.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nightshift import cli


def distribution(where: Path, name: str, commands: dict[str, str], modules: dict[str, str] | None = None) -> None:
    """An installed distribution: its metadata declaring `commands` in the group, and its `modules`."""
    info = where / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{command} = {value}\n" for command, value in commands.items())
    (info / "entry_points.txt").write_text(f"[{cli.COMMAND_GROUP}]\n{lines}")
    for module, text in (modules or {}).items():
        (where / f"{module}.py").write_text(text)


HELLO = '''
def add_parser(subparsers):
    hello = subparsers.add_parser("hello", help="greet")
    hello.add_argument("--who", required=True)
    hello.set_defaults(func=lambda args: {"hello": args.who})
'''


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site-packages folder first on sys.path; the library's own subcommands left out (they cost seconds of
    imports and are not what these tests are about)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMAND_MODULES", ())
    return tmp_path


def test_plan_is_found_through_the_entry_point_the_project_declares(site: Path) -> None:
    points = {point.name: point for point in cli.command_entry_points()}
    assert points["plan"].value == "nightshift_plan.cli:add_parser"
    from nightshift_plan.cli import add_parser

    assert points["plan"].load() is add_parser
    plan = cli.build_parser().parse_args(["plan", "--conf", '{"workers": 3}'])
    assert plan.func.__module__ == "nightshift_plan.cli" and plan.conf == {"workers": 3}


def test_a_distribution_of_ones_own_adds_a_subcommand(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    distribution(site, "acme-commands", {"hello": "acme_hello:add_parser"}, {"acme_hello": HELLO})
    assert cli.main(["hello", "--who", "night"]) == 0
    assert json.loads(capsys.readouterr().out) == {"hello": "night"}
    assert "plan" in cli.build_parser().parse_args(["plan"]).command  # beside this project's own


def test_a_subcommand_that_cannot_load_is_named_and_the_others_still_run(
        site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    distribution(site, "acme-broken", {"broken": "acme_missing:add_parser"})
    distribution(site, "acme-commands", {"hello": "acme_hello:add_parser"}, {"acme_hello": HELLO})
    assert cli.main(["hello", "--who", "x"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "subcommand 'broken' left out: cannot load acme_missing:add_parser" in err
    assert "distribution acme-broken" in err and "No module named 'acme_missing'" in err


def test_a_subcommand_named_like_another_is_refused_naming_its_distribution(
        site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clash = HELLO.replace('"hello"', '"plan"')
    distribution(site, "acme-clash", {"plan2": "acme_clash:add_parser"}, {"acme_clash": clash})
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "'plan2' (acme_clash:add_parser, distribution acme-clash)" in err and "conflicting subparser" in err
