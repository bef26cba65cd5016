"""Imports run down the layers only: nightshift < operators < dags, plugins < top-level tools.

`nightshift/` is the library (it never imports Airflow), `operators/` the Airflow glue, `dags/` (the DAG files and
`nightly_tasks`) and `plugins/` what Airflow loads, and `nightshift_plan/`, `scripts/` and `bench/` the tools on
top. No module imports a layer above its own: not at the top of a file, not inside a function, not through
`importlib.import_module`/`__import__`/`importlib.util.find_spec`/`runpy.run_module` with a literal name, nor
`spec_from_file_location`/`runpy.run_path` or a path to a file under dags/. Read from the source (AST); nothing
is imported. Run as a script, it checks another checkout: `python tests/unit/test_layers.py /work/main`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# (folder, layer) from the bottom up; a file's layer is its folder's.
FOLDERS: tuple[tuple[str, int], ...] = (
    ("nightshift", 0), ("operators", 1), ("dags", 2), ("plugins", 2),
    ("nightshift_plan", 3), ("scripts", 3), ("bench", 3),
)
LAYER_NAMES = ("nightshift", "operators", "dags/plugins", "top-level tools")
# Calls that import the module their first (literal) argument names, by their last name.
IMPORTING_CALLS = frozenset({"import_module", "__import__", "find_spec", "run_module"})
# Calls that load a file: the module name (first argument) and the path (second, or the first for run_path).
FILE_LOADING_CALLS = frozenset({"spec_from_file_location", "run_path"})
DAGS = "dags"


@dataclass(frozen=True)
class Import:
    """One import a file makes: what it names (a module, or a path under dags/) and where."""

    line: int
    target: str
    how: str


def module_layers(root: Path) -> dict[str, int]:
    """The layer of each top-level module name the project's folders make importable."""
    layers = {folder: layer for folder, layer in FOLDERS}
    for path in (root / DAGS).glob("*.py"):  # the DAG files: Airflow puts dags/ on sys.path
        layers[path.stem] = 2
    for path in (root / DAGS).glob("*/__init__.py"):  # nightly_tasks
        layers[path.parent.name] = 2
    for path in (root / "plugins").glob("*.py"):  # Airflow puts plugins/ on sys.path too
        layers[path.stem] = 2
    return layers


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of bare string statements (docstrings and the like): prose, not paths."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _names_a_dags_path(text: str, dag_files: set[str]) -> bool:
    parts = [p for p in text.replace("\\", "/").split("/") if p]
    return text.startswith(f"{DAGS}/") or f"/{DAGS}/" in text or (bool(parts) and parts[-1] in dag_files)


def imports_of(source: str, dag_files: Collection[str] = ()) -> list[Import]:
    """Every module (and path under dags/) that `source` imports or loads, at any depth."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:  # relative: its own package
            found.append(Import(node.lineno, node.module, "from-import"))
        elif isinstance(node, ast.Call) and (called := _called_name(node)) is not None:
            args = [*node.args, *(k.value for k in node.keywords if k.arg in ("name", "location", "path_name"))]
            if called in IMPORTING_CALLS and (name := _literal(args[0] if args else None)):
                found.append(Import(node.lineno, name, f"{called}()"))
            elif called in FILE_LOADING_CALLS:
                for arg in args[:2]:
                    text = _literal(arg)
                    if text and called == "spec_from_file_location" and arg is args[0]:
                        found.append(Import(node.lineno, text, f"{called}()"))
                    elif text and _names_a_dags_path(text, dag_files):
                        found.append(Import(node.lineno, f"{DAGS}/{text.rsplit('/', 1)[-1]}", f"{called}()"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _literal(node.right) == DAGS:
            found.append(Import(node.lineno, f"{DAGS}/", "path / 'dags'"))  # REPO / "dags": the DAG folder
        elif (isinstance(node, ast.Constant) and id(node) not in prose and (text := _literal(node))
              and _names_a_dags_path(text, dag_files)):
            found.append(Import(node.lineno, f"{DAGS}/{text.rsplit('/', 1)[-1]}", "a path under dags/"))
    return found


def _layer_of(target: str, layers: dict[str, int]) -> int | None:
    if target.startswith(f"{DAGS}/"):
        return 2
    return layers.get(target.split(".")[0])


def source_files(root: Path) -> list[tuple[Path, int]]:
    return [(path, layer) for folder, layer in FOLDERS for path in sorted((root / folder).rglob("*.py"))]


def violations(root: Path) -> list[str]:
    """Each import of a layer above the importing file's, as `file:line: how target (layer > layer)`."""
    layers = module_layers(root)
    dag_files = {p.name for p in (root / DAGS).glob("*.py")}
    found = []
    for path, layer in source_files(root):
        for imp in imports_of(path.read_text(), dag_files):
            above = _layer_of(imp.target, layers)
            if above is not None and above > layer:
                found.append(f"{path.relative_to(root)}:{imp.line}: {imp.how} {imp.target} "
                             f"({LAYER_NAMES[above]} is above {LAYER_NAMES[layer]})")
    return found


def airflow_imports(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{imp.line}: {imp.how} {imp.target}"
            for path in sorted((root / "nightshift").rglob("*.py"))
            for imp in imports_of(path.read_text()) if imp.target.split(".")[0] == "airflow"]


# ---- the project ----------------------------------------------------------------------------------------------

def test_no_module_imports_a_layer_above_its_own() -> None:
    assert violations(REPO) == []


def test_nightshift_never_imports_airflow() -> None:
    assert airflow_imports(REPO) == []


def test_every_layer_is_read() -> None:
    # An empty or renamed folder would make the two tests above pass on nothing.
    counts = {folder: len(list((REPO / folder).rglob("*.py"))) for folder, _ in FOLDERS}
    assert all(counts.values()), counts
    layers = module_layers(REPO)
    assert {layers[name] for name in ("nightly_retrain", "nightly_tasks", "nightshift_plugin")} == {2}
    assert layers["nightshift_plan"] == 3 > layers["operators"] > layers["nightshift"]


# ---- what the reader recognises -------------------------------------------------------------------------------

@pytest.mark.parametrize(("source", "target", "how"), [
    ("import operators.horovod\n", "operators.horovod", "import"),
    ("from nightly_tasks.steps import training_options\n", "nightly_tasks.steps", "from-import"),
    ("def f():\n    if True:\n        from nightshift_plan.plan import plan\n", "nightshift_plan.plan", "from-import"),
    ("import importlib\nimportlib.import_module('nightly_tasks.factory')\n", "nightly_tasks.factory",
     "import_module()"),
    ("from importlib import import_module\ndef f():\n    return import_module(name='dags')\n", "dags",
     "import_module()"),
    ("__import__('nightshift_plugin')\n", "nightshift_plugin", "__import__()"),
    ("import importlib.util\nimportlib.util.find_spec('bench.bench_dag')\n", "bench.bench_dag", "find_spec()"),
    ("import runpy\nrunpy.run_module('scripts.demo')\n", "scripts.demo", "run_module()"),
    ("import importlib.util as u\nu.spec_from_file_location('nightly_retrain', where)\n", "nightly_retrain",
     "spec_from_file_location()"),
    ("import importlib.util as u\nu.spec_from_file_location(n, 'dags/nightly_retrain.py')\n",
     "dags/nightly_retrain.py", "spec_from_file_location()"),
    ("import runpy\nrunpy.run_path('/srv/repo/dags/model_search.py')\n", "dags/model_search.py", "run_path()"),
    ("REPO = Path(__file__).parents[1]\nDAGS_DIR = REPO / 'dags'\n", "dags/", "path / 'dags'"),
    ("DAG_FILE = 'nightly_retrain.py'\n", "dags/nightly_retrain.py", "a path under dags/"),
])
def test_every_way_of_importing_is_seen(source: str, target: str, how: str) -> None:
    found = imports_of(source, {"nightly_retrain.py", "model_search.py"})
    assert (target, how) in [(i.target, i.how) for i in found], found


@pytest.mark.parametrize("source", [
    '"""Rendered from dags/nightly_retrain.py, as the DAG file says."""\n',  # prose
    "def f():\n    '''see dags/model_search.py'''\n",
    "from . import steps\nfrom .factory import pipeline_for\n",  # relative: its own package
    "import importlib\nimportlib.import_module(name)\n",  # not a literal: nothing to judge
    'CODE_PATHS = ("nightshift", "operators", "dags")\n',  # folder names hashed, not loaded
])
def test_what_is_not_an_import_is_not_counted(source: str) -> None:
    found = imports_of(source, {"nightly_retrain.py", "model_search.py"})
    assert [i for i in found if i.target.split(".")[0] != "importlib"] == []


def test_a_tree_like_the_one_before_plan_moved_up_fails(tmp_path: Path) -> None:
    files = {
        "nightshift/__init__.py": "",
        "nightshift/plan_cli.py": "def run():\n    from operators.plan import plan\n",
        "nightshift/ok.py": "from nightshift import errors\nimport json\n",
        "operators/__init__.py": "",
        "operators/plan.py": ("import importlib.util\nfrom pathlib import Path\nDAGS_DIR = Path('.') / 'dags'\n"
                              "def load():\n    from nightly_tasks.factory import pipeline_for\n"),
        "operators/horovod.py": "from nightshift.errors import UsageError\n",
        "dags/nightly_retrain.py": "from nightly_tasks.factory import build\nfrom operators.horovod import H\n",
        "dags/nightly_tasks/__init__.py": "",
        "plugins/nightshift_plugin.py": "from nightshift.ledger import read\n",
        "scripts/demo.py": "from nightshift_plan.plan import plan\nimport nightly_retrain\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == [
        "nightshift/plan_cli.py:2: from-import operators.plan (operators is above nightshift)",
        "operators/plan.py:3: path / 'dags' dags/ (dags/plugins is above operators)",
        "operators/plan.py:5: from-import nightly_tasks.factory (dags/plugins is above operators)",
    ]
    (tmp_path / "nightshift" / "ok.py").write_text("import airflow.sdk\n")
    assert airflow_imports(tmp_path) == ["nightshift/ok.py:1: import airflow.sdk"]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    problems = violations(root) + [f"{line} (nightshift never imports Airflow)" for line in airflow_imports(root)]
    print("\n".join(problems) or f"{root}: no upward import")
    sys.exit(1 if problems else 0)
