"""The documentation site's reference pages, generated from the sources of truth at every build.

- `reference/cli.md`: every `nightshift` subcommand, from the argparse parsers `nightshift.cli.build_parser` builds
  (the entry-point subcommands such as `plan` included);
- `reference/pipeline.md`: every key of a pipeline declaration, from `nightshift/pipelines/pipeline.schema.json`;
- `reference/operator.md`: every argument of `HorovodKubernetesOperator`, from its four config dataclasses
  (`operators/horovod_config.py`: fields, defaults, template metadata, the `:param:` text of each class);
- `reference/environment.md`: every `NIGHTSHIFT_*` variable the code reads (`nightshift/settings.py` first), with
  where it is read and which pages of the site describe it.

MkDocs runs this file as a hook (`hooks:` in mkdocs.yml): `on_files` adds the pages to the build, nothing is
written into docs/. `python scripts/gen_reference.py DIR` writes them to DIR to look at.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import html
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SCHEMA = REPO / "nightshift" / "pipelines" / "pipeline.schema.json"
SETTINGS = REPO / "nightshift" / "settings.py"
VARIABLE = re.compile(r"NIGHTSHIFT_[A-Z0-9_]*[A-Z0-9]")
# Where the project reads its variables: the packages, the DAGs and plugin, the scripts, the images and charts.
VARIABLE_SOURCES = ("nightshift", "operators", "dags", "plugins", "nightshift_plan", "config", "scripts", "bench",
                    "images", "deploy/helm", "Makefile", "tests/conftest.py", "tests/integration/browser_helpers.py")
GENERATED = ("reference/cli.md", "reference/pipeline.md", "reference/operator.md", "reference/environment.md")


def text(value: str) -> str:
    """`value` as Markdown inline text: HTML and emphasis characters escaped outside `code spans` (reST's
    ``double`` backticks become single ones)."""
    parts = re.sub(r"``(.+?)``", r"`\1`", value).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = html.escape(parts[i], quote=False).replace("*", r"\*").replace("_", r"\_")
    return "`".join(parts) if len(parts) % 2 else value.replace("`", "'")


def code(value: object) -> str:
    shown = value if isinstance(value, str) else json.dumps(value)
    return f"``{shown}``" if "`" in shown else f"`{shown}`"


# --- the CLI -----------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    if not action.help:
        return ""
    return parser._get_formatter()._expand_help(action)


def _sub_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def cli_commands(parser: argparse.ArgumentParser | None = None, prefix: str = "nightshift"
                 ) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(full command, its parser, its one-line help) for every subcommand, depth first, sorted by name."""
    if parser is None:
        from nightshift.cli import build_parser

        parser = build_parser()
    helps = _sub_help(parser)
    for name, sub in sorted(_subparsers(parser).items()):
        yield f"{prefix} {name}", sub, helps.get(name, "")
        yield from cli_commands(sub, f"{prefix} {name}")


def cli_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's documented arguments (not --help, not a subcommand chooser)."""
    return [a for a in parser._actions if a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def _argument(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    takes_value = action.nargs != 0
    names = ", ".join(f"{o} {metavar}" if takes_value else o for o in action.option_strings) or str(metavar)
    bits = [text(_help(action, parser))]
    if action.choices is not None and not isinstance(action.choices, dict):
        bits.append("one of " + ", ".join(code(str(c)) for c in action.choices))
    if action.option_strings and takes_value and action.default not in (None, argparse.SUPPRESS, [], {}) \
            and "default" not in (action.help or ""):
        bits.append(f"default {code(str(action.default))}")
    if action.required and action.option_strings:
        bits.append("required")
    described = "; ".join(b for b in bits if b)
    return f"- {code(names)}" + (f": {described}" if described else "")


def cli_page() -> str:
    lines = ["# Command line", "",
             "Every step of the DAG is also a subcommand of `nightshift` (installed into `.venv/bin` by "
             "`make setup`). Results go to stdout as JSON, errors to stderr in one line; exit status 2 is a usage "
             "error. This page is generated from the argparse parsers at each build of the site.", "",
             "`python -m nightshift.train` takes the same arguments as `nightshift train` (the training "
             "entrypoint that `horovodrun` and the MPIJob launcher start).", ""]
    for command, parser, summary in cli_commands():
        depth = command.count(" ") + 1
        lines += [f"{'#' * min(depth, 4)} `{command}`", ""]
        description = parser.description or summary
        if description:
            lines += [text(description), ""]
        usage = parser.format_usage().removeprefix("usage: ").strip()
        lines += ["```text", usage, "```", ""]
        flags = cli_flags(parser)
        lines += [_argument(a, parser) for a in flags]
        lines.append("")
    return "\n".join(lines)


# --- the pipeline declaration ---------------------------------------------------------------------------


def schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


def schema_keys(node: dict[str, Any] | None = None, prefix: str = "") -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(dotted key, its schema, required) for every property, depth first, including those declared inside
    `allOf`/`oneOf`/`anyOf` branches and `if`/`then`/`else` (merged by key)."""
    node = schema() if node is None else node
    properties: dict[str, dict[str, Any]] = {}
    required: set[str] = set(node.get("required", []))

    def collect(part: dict[str, Any]) -> None:
        for key, sub in part.get("properties", {}).items():
            properties.setdefault(key, {}).update({k: v for k, v in sub.items() if k not in properties[key]})
        required.update(part.get("required", []) if part is not node else [])
        for combinator in ("allOf", "oneOf", "anyOf"):
            for branch in part.get(combinator, []):
                collect(branch)
        for branch in ("if", "then", "else"):
            if isinstance(part.get(branch), dict) and branch != "if":
                collect(part[branch])

    collect(node)
    for key, sub in properties.items():
        path = f"{prefix}{key}"
        yield path, sub, key in set(node.get("required", []))
        if sub.get("type") == "object" or "properties" in sub or "allOf" in sub:
            yield from schema_keys(sub, f"{path}.")


def _schema_type(sub: dict[str, Any]) -> str:
    kind = sub.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind:
        return str(kind)
    for combinator in ("oneOf", "anyOf"):
        if combinator in sub:
            return " or ".join(_schema_type(b) for b in sub[combinator]) or "see description"
    return "any"


def pipeline_page() -> str:
    root = schema()
    lines = ["# Pipeline declaration", "", text(root.get("description", "")), "",
             "Generated from `nightshift/pipelines/pipeline.schema.json` at each build of the site. "
             "`nightshift pipeline check FILE_OR_DIR` validates a declaration against it.", ""]
    for path, sub, required in schema_keys(root):
        depth = path.count(".")
        lines += [f"{'#' * min(2 + depth, 5)} `{path}`", ""]
        facts = [f"type {_schema_type(sub)}", "required" if required else "optional"]
        if "default" in sub:
            facts.append(f"default {code(json.dumps(sub['default']))}")
        if "enum" in sub:
            facts.append("one of " + ", ".join(code(v) for v in sub["enum"]))
        for bound in ("minimum", "maximum", "exclusiveMinimum", "minLength", "pattern"):
            if bound in sub:
                facts.append(f"{bound} {code(sub[bound])}")
        lines += [text(sub.get("description", "")), "", "*" + "; ".join(facts) + "*", ""]
    return "\n".join(lines)


# --- the operator ------------------------------------------------------------------------------------


def _param_texts(doc: str) -> tuple[str, dict[str, str]]:
    """The docstring's notes (what is not a `:param:`) and each `:param name:`'s text."""
    notes: list[str] = []
    params: dict[str, str] = {}
    current: str | None = None
    for line in (doc or "").splitlines():
        match = re.match(r"\s*:param (\w+):\s*(.*)", line)
        if match:
            current = match[1]
            params[current] = match[2]
        elif current is not None and line.startswith("        ") and line.strip():
            params[current] += " " + line.strip()
        else:
            current = None
            notes.append(line.strip())
    return " ".join(" ".join(notes).split()), params


def operator_fields() -> Iterator[tuple[str, type, dataclasses.Field[Any]]]:
    """(operator keyword argument, config class, field) for every setting of HorovodKubernetesOperator."""
    from operators.horovod_config import CONFIG_TYPES

    for group, kind in CONFIG_TYPES.items():
        for f in dataclasses.fields(kind):  # type: ignore[arg-type]
            yield group, kind, f


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return code(repr(f.default))
    if f.default_factory is not dataclasses.MISSING:
        return "computed at construction"
    return "required"


def operator_page() -> str:
    from operators.horovod_config import CONFIG_TYPES

    lines = ["# `HorovodKubernetesOperator`", "",
             "The operator (`operators.horovod.HorovodKubernetesOperator`) takes its settings as four configs, "
             "each a keyword argument: " + ", ".join(f"`{g}={k.__name__}(...)`" for g, k in CONFIG_TYPES.items())
             + ". Settings can also be given by field name (`operators.horovod_config.configs_from`). A *templated* "
             "field is one of the operator's `template_fields`: Airflow renders it (e.g. "
             "`\"{{ params.workers }}\"`) and the operator converts and checks it at execute, with an error naming "
             "the field. Generated from the dataclasses in `operators/horovod_config.py` at each build.", ""]
    for group, kind in CONFIG_TYPES.items():
        summary, params = _param_texts(kind.__doc__ or "")
        lines += [f"## `{group}`: `{kind.__name__}`", "", text(summary), ""]
        group_of: str | None = None  # a `:param x: ... and the others` covers the fields after it
        for f in dataclasses.fields(kind):  # type: ignore[arg-type]
            description = params.get(f.name)
            if description is not None:
                group_of = f.name if description.startswith("...") else None
            else:
                owner = next((name for name, body in params.items() if f"`{f.name}`" in body), group_of)
                description = f"see `{owner}`" if owner else "see the notes above"
            templated = "templated" if f.metadata.get("templated") else "not templated"
            kind_text = str(f.type)
            lines.append(f"- **`{f.name}`** ({code(kind_text)}; default {_default(f)}; {templated}): "
                         f"{text(description)}")
        lines.append("")
    return "\n".join(lines)


# --- the environment ----------------------------------------------------------------------------------


def _source_files() -> Iterator[Path]:
    for name in VARIABLE_SOURCES:
        path = REPO / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                              and p.suffix in {".py", ".sh", ".yaml", ".yml", ".conf", ""})


def _python_reads(path: Path) -> Iterator[tuple[str, str, int]]:
    """(variable, the function or class it is read in, line): string constants that are exactly a variable's name."""
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return

    def visit(node: ast.AST, scope: str) -> Iterator[tuple[str, str, int]]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = scope or node.name  # the outermost function or class
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
            yield node.value, scope, node.lineno
        for child in ast.iter_child_nodes(node):
            yield from visit(child, scope)

    yield from visit(tree, "")


_SHELL_USE = re.compile(r"(?<![A-Za-z0-9_])(?:\$\{|\$\(|\$|ENV |ARG |export |- name: )(NIGHTSHIFT_[A-Z0-9_]*[A-Z0-9])"
                        r"|^\s*(?:export )?(NIGHTSHIFT_[A-Z0-9_]*[A-Z0-9]) *[?:]?=", re.M)
# Python embedded in a shell script (`python -c '...'`, a heredoc): os.environ["X"], os.environ.get("X"),
# os.getenv("X"), environ.setdefault / pop.
_EMBEDDED_PYTHON_READ = re.compile(r"""\b(?:environ\[|environ\.(?:get|setdefault|pop)\(|getenv\()\s*"""
                                   r"""["'](NIGHTSHIFT_[A-Z0-9_]*[A-Z0-9])["']""")


def _other_reads(path: Path) -> Iterator[tuple[str, str, int]]:
    """Variables a shell script, Makefile, Dockerfile or chart sets or expands, or Python embedded in it reads,
    as `_python_reads` gives them, in the order they come in the file."""
    try:
        content = path.read_text()
    except UnicodeDecodeError:
        return
    matches = [*_SHELL_USE.finditer(content), *_EMBEDDED_PYTHON_READ.finditer(content)]
    for match in sorted(matches, key=lambda m: m.start()):
        name = next(group for group in match.groups() if group)
        yield name, "", content.count("\n", 0, match.start()) + 1


def _comment_above(lines: list[str], line: int) -> str:
    """The `#` comment lines right above line `line` (1-based), joined."""
    found: list[str] = []
    i = line - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        found.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(found)


def variables() -> dict[str, dict[str, Any]]:
    """Every NIGHTSHIFT_* variable the project reads: where; the line that reads it first (settings.py's first);
    and what it is for: settings.py's docstring of the function reading it, else the comment above that line."""
    found: dict[str, dict[str, Any]] = {}
    settings_docs: dict[str, str] = {}
    tree = ast.parse(SETTINGS.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            doc = ast.get_docstring(node) or ""
            for child in ast.walk(node):
                if isinstance(child, ast.Constant) and isinstance(child.value, str) \
                        and VARIABLE.fullmatch(child.value) and doc:
                    settings_docs.setdefault(child.value, doc.split("\n\n")[0])
    for path in sorted(_source_files(), key=lambda p: p != SETTINGS):
        where = str(path.relative_to(REPO))
        content = path.read_text(errors="replace")
        if "NIGHTSHIFT_" not in content:
            continue
        lines = content.splitlines()
        reads = _python_reads(path) if path.suffix == ".py" else _other_reads(path)
        for name, scope, line in reads:
            entry = found.setdefault(name, {"where": {}, "doc": settings_docs.get(name, ""), "code": ""})
            entry["where"].setdefault(where, set())
            if scope:
                entry["where"][where].add(scope)
            if not entry["code"] and 0 < line <= len(lines):
                entry["code"] = lines[line - 1].strip()
                entry["doc"] = entry["doc"] or _comment_above(lines, line)
    for name in VARIABLE.findall(SETTINGS.read_text()):  # settings.py's own, whatever form they take there
        found.setdefault(name, {"where": {"nightshift/settings.py": set()}, "doc": settings_docs.get(name, ""),
                                "code": ""})
    return dict(sorted(found.items()))


def _pages_mentioning(name: str, pages: dict[str, str]) -> list[str]:
    return sorted(page for page, content in pages.items() if re.search(rf"(?<![A-Z0-9_]){name}(?![A-Z0-9_])", content))


def environment_page(docs: Path = DOCS) -> str:
    lines = ["# Environment variables", "",
             "Every `NIGHTSHIFT_*` variable the project reads, found in its sources at each build of the site "
             "(`nightshift/settings.py` holds where state lives; the others are read where they are used). "
             "`NIGHTSHIFT_*` variables reach the training ranks (the local backend's allowlist): never put a "
             "secret in one; name a file that holds it instead.", ""]
    written = {str(p.relative_to(docs)): p.read_text() for p in sorted(docs.rglob("*.md"))
               if not str(p.relative_to(docs)).startswith("reference/")}
    for name, entry in variables().items():
        lines += [f"## `{name}`", ""]
        if entry["doc"]:
            lines += [text(" ".join(entry["doc"].split())), ""]
        where = [f"`{path}`" + (f" ({', '.join(f'`{s}`' for s in sorted(scopes))})" if scopes else "")
                 for path, scopes in sorted(entry["where"].items())]
        lines += ["Read in " + ", ".join(where) + ".", ""]
        if entry["code"] and len(entry["code"]) <= 200:
            lines += [f"In the code: {code(entry['code'])}", ""]
        pages = _pages_mentioning(name, written)
        if pages:
            lines += ["Described in " + ", ".join(f"[{page.removesuffix('.md')}](../{page})" for page in pages)
                      + ".", ""]
    return "\n".join(lines)


# --- the pages -----------------------------------------------------------------------------------------


def pages(docs: Path = DOCS) -> dict[str, str]:
    """Each generated page's path under docs/ and its Markdown."""
    return {"reference/cli.md": cli_page(), "reference/pipeline.md": pipeline_page(),
            "reference/operator.md": operator_page(), "reference/environment.md": environment_page(docs)}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site (nothing is written into docs/)."""
    from mkdocs.structure.files import File

    for path, content in pages(Path(config["docs_dir"])).items():
        files.append(File.generated(config, path, content=content))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the generated reference pages to a directory")
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    for path, content in pages().items():
        target = args.out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        print(target)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
