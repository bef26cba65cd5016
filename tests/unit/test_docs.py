"""The documentation site (mkdocs.yml, docs/, the reference pages scripts/gen_reference.py generates at each build).

The reference is generated from the sources of truth; these tests walk the same sources on their own (the argparse
parsers, the JSON Schema, the operator's config dataclasses, nightshift/settings.py) and fail when one thing there
has no generated entry, and when the built site lacks it. The README is the front door: short, its links alive.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import gen_reference

REPO = Path(__file__).resolve().parents[2]


def sections(page: str) -> dict[str, str]:
    """Each heading's code span (`## `name``) and the text below it up to the next heading."""
    found: dict[str, str] = {}
    for match in re.finditer(r"^#+ `([^`]+)`\n(.*?)(?=^#+ |\Z)", page, re.M | re.S):
        found[match[1]] = match[2]
    return found


# --- the sources, walked here on their own -----------------------------------------------------------


def settings_variables() -> set[str]:
    return set(re.findall(r"NIGHTSHIFT_[A-Z0-9_]*[A-Z0-9]", (REPO / "nightshift" / "settings.py").read_text()))


def parsers(parser: argparse.ArgumentParser, prefix: str = "nightshift"
            ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from parsers(sub, f"{prefix} {name}")


def schema_paths(node: dict, prefix: str = "") -> Iterator[str]:
    """Every key a declaration may hold, as a dotted path: properties, also those inside allOf/oneOf/anyOf/then."""
    branches = [node, *node.get("allOf", []), *node.get("oneOf", []), *node.get("anyOf", [])]
    branches += [node[key] for key in ("then", "else") if isinstance(node.get(key), dict)]
    for branch in branches:
        for key, sub in branch.get("properties", {}).items():
            yield f"{prefix}{key}"
            yield from schema_paths(sub, f"{prefix}{key}.")


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return gen_reference.pages()


def test_every_settings_variable_has_an_entry(pages: dict[str, str]) -> None:
    variables = settings_variables()
    assert "NIGHTSHIFT_HOME" in variables and len(variables) >= 10
    documented = sections(pages["reference/environment.md"])
    missing = sorted(variables - set(documented))
    assert not missing, f"nightshift/settings.py reads {missing}, which reference/environment.md lacks"
    # settings.py's docstrings say what a variable is for
    assert "ReadWriteMany" in documented["NIGHTSHIFT_SHARED_PVC"]


# Where the code reads its variables (tests/ and bench/ read their own, which need no entry).
CODE_DIRS = ("nightshift", "operators", "plugins", "dags", "scripts", "nightshift_plan", "images", "deploy")
# Names the code spells that are not variables it reads, so they need no entry (a name only a test reads goes here
# too, with why):
NOT_VARIABLES = {
    "NIGHTSHIFT_": "a prefix: the local launcher's allowlist (operators/local_launcher.py), `NIGHTSHIFT_*` in text",
    "NIGHTSHIFT_AIRFLOW_": "a prefix: NIGHTSHIFT_AIRFLOW_*_RETENTION_DAYS in nightshift_maintenance's description",
    "NIGHTSHIFT_GITHUB_PAT": "an example of a name redaction hides (nightshift/redaction.py's comments)",
    "NIGHTSHIFT_JWT_FILE": "an example of a name redaction hides (nightshift/redaction.py's comments)",
    "NIGHTSHIFT_SIGNING_KEY": "an example of a name redaction hides (nightshift/redaction.py's comments)",
}


def code_variables() -> dict[str, set[str]]:
    """Every NIGHTSHIFT_* name spelled in the code (any file, any language: Python, shell and the Python embedded in
    it, Dockerfiles, charts), each with the files that spell it."""
    found: dict[str, set[str]] = {}
    for directory in CODE_DIRS:
        for path in sorted((REPO / directory).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                content = path.read_text()
            except UnicodeDecodeError:
                continue
            for name in re.findall(r"(?<![A-Za-z0-9_])NIGHTSHIFT_[A-Z0-9_]*", content):
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def test_a_variable_read_anywhere_in_the_code_has_an_entry(pages: dict[str, str]) -> None:
    """Every NIGHTSHIFT_* name the code spells, found here on its own (a plain text search of every file, not the
    generator's patterns: scripts/airflow.sh reads two in the Python it embeds), has an entry."""
    documented = set(sections(pages["reference/environment.md"]))
    spelled = code_variables()
    assert {"NIGHTSHIFT_RETRAIN_CRON", "NIGHTSHIFT_TRAINER_IMAGE", "NIGHTSHIFT_DAG_BUNDLE_BRANCH"} <= set(spelled)
    missing = {name: sorted(files) for name, files in spelled.items()
               if name not in documented and name not in NOT_VARIABLES}
    assert not missing, f"the code reads {missing}, which reference/environment.md lacks"
    # the exclusions stay true: each is still spelled in the code and is not a variable with an entry
    stale = sorted(name for name in NOT_VARIABLES if name not in spelled or name in documented)
    assert not stale, f"NOT_VARIABLES lists {stale}, which the code no longer spells or which has an entry"
    # and those read outside CODE_DIRS (the Makefile, tests/conftest.py) keep theirs
    for name in ("NIGHTSHIFT_GIT_COMMIT", "NIGHTSHIFT_CACHE", "NIGHTSHIFT_VENV_BIN", "NIGHTSHIFT_INSTANCE",
                 "NIGHTSHIFT_ARTIFACTS"):
        assert name in documented
    # the generator takes a variable's description from the comment above where it is read, in embedded Python too
    entries = sections(pages["reference/environment.md"])
    assert "The branch of the repository" in entries["NIGHTSHIFT_DAG_BUNDLE_BRANCH"]
    assert "The DAG folder inside" in entries["NIGHTSHIFT_DAG_BUNDLE_SUBDIR"]


def test_every_cli_command_and_flag_has_an_entry(pages: dict[str, str]) -> None:
    from nightshift.cli import build_parser

    documented = sections(pages["reference/cli.md"])
    commands = dict(parsers(build_parser()))
    assert {"nightshift plan", "nightshift run-mpijob", "nightshift suite init", "nightshift train"} <= set(commands)
    for command, parser in commands.items():
        assert command in documented, f"{command} has no section in reference/cli.md"
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert re.search(rf"`{re.escape(flag)}[ `,]", documented[command]), f"{command} {flag} is missing"


def test_every_schema_key_has_an_entry(pages: dict[str, str]) -> None:
    schema = json.loads((REPO / "nightshift" / "pipelines" / "pipeline.schema.json").read_text())
    keys = set(schema_paths(schema))
    assert {"dag_id", "dataset.loader", "gate.primary", "retention.keep_runs", "training.backend"} <= keys
    missing = sorted(keys - set(sections(pages["reference/pipeline.md"])))
    assert not missing, f"pipeline.schema.json has {missing}, which reference/pipeline.md lacks"


def test_every_operator_argument_has_an_entry(pages: dict[str, str]) -> None:
    from operators.horovod_config import CONFIG_TYPES

    page = pages["reference/operator.md"]
    for group, kind in CONFIG_TYPES.items():
        section = page.split(f"## `{group}`: `{kind.__name__}`", 1)[1].split("\n## ", 1)[0]
        for field in dataclasses.fields(kind):  # type: ignore[arg-type]
            assert f"- **`{field.name}`** (" in section, f"{kind.__name__}.{field.name} is missing"
    assert "templated" in page and "{{ params.workers }}" in page


def test_markdown_escaping_keeps_code_spans_and_stops_html() -> None:
    assert gen_reference.text("a <job> of `<pod>` *x*") == r"a &lt;job&gt; of `<pod>` \*x\*"


def test_the_readme_is_a_front_door_whose_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "make demo" in readme and "make test" in readme
    links = re.findall(r"\]\(([^)#]+)", readme)
    assert links
    for link in links:
        if not link.startswith("http"):
            assert (REPO / link).exists(), f"README links to {link}, which does not exist"


def test_every_page_of_docs_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    for page in pages:
        assert f": {page}" in nav, f"docs/{page} is not in mkdocs.yml's nav"
    for generated in gen_reference.GENERATED:
        assert f": {generated}" in nav and generated not in pages


def test_the_pages_that_move_from_the_readme_say_what_the_tests_hold() -> None:
    """Facts other tests check in the docs (the registry table, the Secrets) live on these pages."""
    assert "| `operators.backends` |" in (REPO / "docs" / "concepts" / "backends.md").read_text()
    assert "## From `make demo` to a cluster" in (REPO / "docs" / "how-to" / "kubernetes.md").read_text()


def factory_tasks() -> list[str]:
    """The task ids dags/nightly_tasks/factory.py's build_dag creates, in the order of its source: each operator's
    `task_id=`, each function decorated with `@task...` (read with ast: importing the factory imports Airflow)."""
    tree = ast.parse((REPO / "dags" / "nightly_tasks" / "factory.py").read_text())
    build = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "build_dag")
    found: list[tuple[int, str]] = []
    for node in ast.walk(build):
        if isinstance(node, ast.Call):
            found += [(node.lineno, k.value.value) for k in node.keywords
                      if k.arg == "task_id" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)]
        elif isinstance(node, ast.FunctionDef) and node is not build and any(
                "task" in ast.unparse(d).split("(")[0].split(".") for d in node.decorator_list):
            found.append((node.lineno, node.name))
    return [name for _, name in sorted(found)]


def test_the_home_page_draws_the_dag_the_factory_builds() -> None:
    """docs/index.md's picture is the README's text picture, and names the factory's tasks: those of the trained
    path on its first line in the order the factory makes them, and skip_training on the branch below."""
    tasks = factory_tasks()
    assert tasks[:3] == ["validate_data", "stage_dataset", "check_changes"] and "collect_garbage" in tasks
    picture = (REPO / "docs" / "index.md").read_text().split("```text\n", 1)[1].split("```", 1)[0]
    readme = (REPO / "README.md").read_text().split("The same, as text:\n\n```\n", 1)[1].split("```", 1)[0]
    assert picture == readme, "docs/index.md's DAG picture differs from the README's"
    first, *rest = picture.splitlines()
    assert re.findall(r"[a-z_]+", first) == [t for t in tasks if t != "skip_training"]
    assert re.findall(r"\b[a-z]+_[a-z_]+\b", rest[-1]) == ["skip_training"]


def test_the_security_page_states_what_a_decision_page_asks_and_its_policy() -> None:
    """operations/security.md quotes the permission the plugin's decisions route checks and the CSP it serves the
    page with (read from plugins/nightshift_plugin.py, which this test does not import: it would import Airflow)."""
    source = (REPO / "plugins" / "nightshift_plugin.py").read_text()
    policy = next(ast.literal_eval(node.value) for node in ast.parse(source).body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "PAGE_CSP" for t in node.targets))
    assert 'requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN' in source
    assert '@pipeline_docs.get("/decisions/{dag_id}/{path:path}")' in source
    page = " ".join((REPO / "docs" / "operations" / "security.md").read_text().split())
    assert "`/nightshift/decisions/<dag_id>/<MLflow run id>/decision.html`" in page
    assert "`GET` the DAG runs (`DagAccessEntity.RUN`) of the DAG the path names" in page
    assert f"`Content-Security-Policy: {policy}`" in page


@pytest.mark.slow
def test_the_built_site_holds_every_generated_entry(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    environment = (site / "reference" / "environment.html").read_text()
    for name in settings_variables():
        assert f"<code>{name}</code>" in environment
    cli = (site / "reference" / "cli.html").read_text()
    assert "<code>nightshift run-mpijob</code>" in cli and "--against" in cli
    assert "<code>retention.keep_runs</code>" in (site / "reference" / "pipeline.html").read_text()
    assert "<code>kueue_queue</code>" in (site / "reference" / "operator.html").read_text()
    first = (REPO / "bench" / "RESULTS.md").read_text().splitlines()[0].lstrip("# ")
    assert first in (site / "benchmarks.html").read_text()  # included, not copied
    for page in site.rglob("*.html"):
        html = page.read_text()
        assert not re.search(r"<script[^>]+src=\"(https?:)?//", html), f"{page} loads a script from another origin"
        assert "fonts.googleapis" not in html and "fonts.gstatic" not in html, f"{page} loads Google Fonts"
