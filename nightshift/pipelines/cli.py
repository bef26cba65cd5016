"""Subcommands `pipeline check` (declarations against the schema, each other, every declaration Airflow loads, the
loader's and model's signatures and their data), `pipeline explain` (the gate a declaration gets) and `suite init`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nightshift.pipelines.spec import NO_MISSING_VALUES, TABULAR


def add_parser(subparsers: Any) -> None:
    pipeline = subparsers.add_parser("pipeline", help="pipeline declarations (pipelines/*.yaml)")
    actions = pipeline.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="check declarations: one line per problem on stderr, exit 1 if any")
    check.add_argument("paths", nargs="+", metavar="FILE_OR_DIR",
                       help="a declaration, or a folder whose *.yaml declarations are checked together")
    check.add_argument("--no-data", action="store_true",
                       help="skip the checks against the data (label column, suite columns, numeric features, "
                            "the positive class)")
    check.add_argument("--dags-folder", metavar="DIR",
                       help="Airflow's DAG folder, whose declarations (and NIGHTSHIFT_PIPELINES's, default: the "
                            "pipelines folder beside it) may share no dag_id, model_name or dataset asset with the "
                            "ones checked (default: AIRFLOW__CORE__DAGS_FOLDER, else $AIRFLOW_HOME/dags)")
    check.set_defaults(func=_check)
    explain = actions.add_parser("explain", help="the gate a declaration really gets: each key, where it came from "
                                                 "(declaration or the task's default), and the rules around it")
    explain.add_argument("declaration", metavar="DECL", help="a declaration (YAML file)")
    explain.add_argument("--no-data", action="store_true",
                         help="do not read the train split's labels (binary: which class the default positive "
                              "class is)")
    explain.set_defaults(func=_explain)

    suite = subparsers.add_parser("suite", help="GX expectation suites")
    suite_actions = suite.add_subparsers(dest="action", required=True)
    init = suite_actions.add_parser("init", help="draw a suite from a known-good sample, for review")
    init.add_argument("data", help="a Parquet file, or a directory of them (e.g. train/validation/test.parquet)")
    init.add_argument("--label", required=True, help="the label column")
    init.add_argument("--out", required=True, help="the suite JSON file to write")
    init.add_argument("--name", help="the suite's name (default: the file name without .json)")
    init.add_argument("--task", choices=("binary", "multiclass", "regression"),
                      help="what the label is (the declaration's task): a class label gets its set of classes, a "
                           "regression target a range and a distribution (default: inferred from the label)")
    init.add_argument("--loader", default=TABULAR, metavar="NAME",
                      help="the dataset loader of the pipeline the suite is for (default: tabular): for one that "
                           "takes no missing value (tabular, digits), a sample with nulls is refused rather than "
                           "drawn into a suite that lets nulls through to a training that refuses them")
    init.add_argument("--force", action="store_true", help="replace --out when it exists")
    init.set_defaults(func=_init)


def check_paths(paths: list[str], *, data: bool = True,
                folders: list[Path] | None = None) -> tuple[list[str], list[str]]:
    """(the dag_ids of the valid declarations, one line per problem) for files and folders of declarations; a
    dag_id, model_name or dataset asset declared twice anywhere among them, or also declared in `folders` (default:
    the folders Airflow loads declarations from, `declaration_folders()`), refuses the file."""
    from nightshift.errors import UsageError
    from nightshift.pipelines import PipelineInvalid, check_against_data, clashes, load_pipeline, load_pipelines
    from nightshift.pipelines.check import check_declaration
    from nightshift.pipelines.load import declaration_folders, declared_elsewhere

    good = []
    problems: list[str] = []
    for given in paths:
        path = Path(given)
        try:
            if path.is_dir():
                loaded, errors = load_pipelines(path)
                good.extend(loaded)
                problems.extend(line for err in errors for line in err.problems)
            else:
                good.append(load_pipeline(path))
        except PipelineInvalid as err:
            problems.extend(err.problems)
        except UsageError as err:
            problems.append(f"{given}: {err}")
    # dag_id, model_name and dataset asset are unique across everything given, not only within one folder.
    across = clashes(good)
    # ... and with every other declaration beside them or where Airflow loads declarations from, as the DAG factory.
    sources = [Path(str(p.source)) for p in good]
    folders = declaration_folders() if folders is None else folders
    for pipeline in good:
        elsewhere = declared_elsewhere(pipeline, folders, skip=sources)
        if elsewhere:
            across.setdefault(Path(str(pipeline.source)), []).extend(elsewhere)
    problems.extend(f"{file}: {line}" for file, lines in across.items() for line in lines)
    good = [p for p in good if Path(str(p.source)) not in across]
    valid = []
    for pipeline in good:
        found = check_declaration(pipeline) + (check_against_data(pipeline) if data else [])
        problems.extend(found)
        if not found:
            valid.append(pipeline.dag_id)
    return valid, problems


def _check(args: argparse.Namespace) -> dict[str, Any] | int:
    from nightshift.pipelines.load import declaration_folders

    folders = declaration_folders(args.dags_folder)
    valid, problems = check_paths(args.paths, data=not args.no_data, folders=folders)
    for line in problems:
        print(line, file=sys.stderr)
    from nightshift.cli import emit

    emit({"valid": valid, "problems": problems, "compared_with": [str(folder) for folder in folders]})
    return 1 if problems else 0


def _explain(args: argparse.Namespace) -> dict[str, Any] | int:
    from nightshift.pipelines import PipelineInvalid
    from nightshift.pipelines.explain import explain, readable

    try:
        result = explain(args.declaration, data=not args.no_data)
    except PipelineInvalid as err:  # every problem, as pipeline check says them: the first alone may mislead
        for line in err.problems:
            print(line, file=sys.stderr)
        return err.exit_code
    for line in readable(result):
        print(line, file=sys.stderr)
    return result


def _init(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.data.suite_init import init_suite
    from nightshift.pipelines.check import takes_missing_values

    loader = getattr(args, "loader", TABULAR)
    factory = None
    if loader not in NO_MISSING_VALUES:
        from nightshift.datasets import DATASETS

        factory = DATASETS.get(loader)  # an unknown loader: UsageError naming the known ones
    written = init_suite(args.data, args.label, args.out, force=args.force, name=args.name,
                         task=getattr(args, "task", None), nulls=takes_missing_values(loader, factory),
                         loader=loader)
    print(f"wrote {written['out']} ({len(written['expectations'])} expectations from {written['rows']} rows); "
          f"review it before use:", file=sys.stderr)
    for line in written["expectations"]:
        print(f"  {line}", file=sys.stderr)
    return written
