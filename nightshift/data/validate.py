"""Validate a dataset against the Great Expectations suite kept in `gx/`, with Data Docs in NIGHTSHIFT_HOME.

The suite JSON in `gx/expectations/` is the source of truth, reviewed in git. At run time it is loaded
into an ephemeral GX context (nothing is written into the repository; concurrent runs share no GX
state) whose Data Docs site lives under `NIGHTSHIFT_HOME/gx/data_docs/`.

Speed: a passing run costs one pass with result format BOOLEAN_ONLY (no unexpected-value lists are
collected). Only when it fails is the suite re-run with SUMMARY to collect sample unexpected values
for the report and the Data Docs page. Rules over many columns are one wide expectation each
(`nightshift.data.expectations`), so GX's fixed cost per expectation does not grow with the column
count; their results name each failing column, and the report lists one failure per column.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import pandas as pd

from nightshift import settings
from nightshift.data.files import open_regular, read_regular
from nightshift.errors import DataError, DataValidationFailed, UsageError

if TYPE_CHECKING:
    import great_expectations as gx
    from great_expectations.core.expectation_validation_result import ExpectationSuiteValidationResult

SUITE = "digits"
DOCS_SITE = "nightshift"
SAMPLE_SIZE = 5
# Failures named in the one-line error; the JSON report lists all of them.
SUMMARY_FAILURES = 8
# Which tables get a Data Docs page: every one, only those that fail, or none.
DataDocs = bool | Literal["failed"]

# GX logs its internals at INFO: on import ~200 "Skipping registering function ..." lines (its public-API
# docs registry), then "Multiple declarations of metric ...", "Created temporary directory ..." per context.
QUIET_GX_LOGGERS = ("great_expectations",)
# A module that sets its own logger to INFO when it is imported.
GX_LOGGER_AT_INFO = "great_expectations.data_context.types.base"


class ExpectationFailure(TypedDict):
    expectation: str
    column: str | None
    rule: str
    unexpected_count: int | None
    sample: list[Any]
    observed: Any


class FileReport(TypedDict):
    path: str
    rows: int
    success: bool
    failures: list[ExpectationFailure]
    data_docs: str | None


class ValidationReport(TypedDict):
    """What `nightshift validate` prints: one entry per Parquet file validated."""

    path: str
    suite: str
    success: bool
    files: list[FileReport]


gx_dir = settings.gx_dir
data_docs_dir = settings.data_docs_dir


def _new_site_dir(pipeline: str | None = None) -> Path:
    # One site per validation run: GX prunes pages its (ephemeral) result store does not know, so
    # runs sharing a site would delete each other's pages.
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    parent = settings.pipeline_data_docs_dir(pipeline) if pipeline is not None else data_docs_dir()
    return parent / f"{stamp}-{uuid.uuid4().hex[:8]}"


@lru_cache(maxsize=8)
def _suite_json(path: str, mtime_ns: int, size: int) -> str:
    # Keyed by the file's mtime and size too: a suite rewritten (`nightshift suite init --force`) is read again.
    return Path(path).read_text()


def load_suite(name: str = SUITE) -> gx.ExpectationSuite:
    """The suite `name` from `gx/expectations/` as a GX object (e.g. for the Airflow provider)."""
    path = gx_dir() / "expectations" / f"{name}.json"
    if not path.is_file():
        raise UsageError(f"expectation suite {name!r} not found at {path}; set NIGHTSHIFT_GX_DIR to gx/")
    return load_suite_file(path)


def load_suite_file(path: str | Path) -> gx.ExpectationSuite:
    """The suite JSON file `path` (a pipeline's suite, or one `nightshift suite init` wrote) as a GX object."""
    quiet_gx_logging()
    import great_expectations as gx

    import nightshift.data.expectations  # noqa: F401  (registers the custom expectations the suite uses)

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"expectation suite file {path} not found")
    stat = path.stat()
    try:
        data = json.loads(_suite_json(str(path.resolve()), stat.st_mtime_ns, stat.st_size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"expectation suite file {path} is not a GX expectation suite: not readable JSON "
                         f"({err})") from err
    if not (isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"]
            and isinstance(data.get("expectations"), list)
            and all(isinstance(e, dict) for e in data["expectations"])):
        raise UsageError(f"expectation suite file {path} is not a GX expectation suite: expected a JSON object "
                         f"with a 'name' and a list of 'expectations' (write one with `nightshift suite init`)")
    data.pop("id", None)
    for expectation in data["expectations"]:
        expectation.pop("id", None)
    if not data["expectations"]:
        raise UsageError(f"expectation suite file {path} has no expectations: it would pass any data; write one "
                         f"with `nightshift suite init`")
    try:
        suite = gx.ExpectationSuite(**data)
    except (ValueError, TypeError, gx.exceptions.GreatExpectationsError) as err:  # pydantic: a ValueError
        raise UsageError(f"expectation suite file {path}: {_unbuildable(data, err)}; fix its kwargs") from err
    # GX logs and drops an expectation whose type it does not know: that rule would silently check nothing.
    built = Counter(e.expectation_type for e in suite.expectations)
    dropped = Counter(e.get("type") for e in data["expectations"]) - built
    if dropped:
        raise UsageError(f"expectation suite file {path} names expectation types GX does not know: "
                         f"{', '.join(sorted(map(str, dropped)))}; fix the type (a typo?) or register it")
    return suite


def _unbuildable(data: dict[str, Any], err: Exception) -> str:
    """Which expectation of suite JSON `data` GX could not build (`err`), and why, in one line."""
    import great_expectations as gx

    for expectation in data["expectations"]:
        try:
            gx.ExpectationSuite(name=data["name"], expectations=[expectation])
        except (ValueError, TypeError, gx.exceptions.GreatExpectationsError) as found:
            return f"{expectation.get('type')} {json.dumps(expectation.get('kwargs'))} is invalid: " \
                   f"{' '.join(str(found).split())}"
    return " ".join(str(err).split())


def _add_suite(digest: Any, suite: str | Path) -> None:
    # A name is gx/'s suite of that name; a Path, a suite file (a pipeline's own).
    suite_file = suite if isinstance(suite, Path) else gx_dir() / "expectations" / f"{suite}.json"
    for part in (suite_file, Path(__file__).with_name("expectations.py")):
        digest.update(part.name.encode() + b"\0" + (part.read_bytes() if part.is_file() else b"") + b"\0")


def suite_fingerprint(suite: str | Path = SUITE) -> str:
    """The suite's part of `fingerprint` alone (its JSON and the custom expectations' code): a few KB read."""
    digest = hashlib.sha256()
    _add_suite(digest, suite)
    return f"sha256:{digest.hexdigest()}"


def fingerprint(path: str | Path, suite: str | Path = SUITE) -> str:
    """What a validation result is about: the suite (its JSON and the custom expectations' code) and every
    data file's name and bytes. Staging trusts a passed gate only for the same fingerprint. `suite`: gx/'s suite
    of that name, or (a Path) a suite file."""
    digests = {}
    for file in parquet_files(path):
        fd = open_regular(file)
        with open(fd, "rb") as handle:
            digests[file.name] = hashlib.file_digest(handle, "sha256").digest()
    return fingerprint_of(digests, suite)


def fingerprint_of(digests: Mapping[str, bytes], suite: str | Path = SUITE) -> str:
    """`fingerprint` from each data file's name and SHA-256 digest, for bytes the caller has already read."""
    digest = hashlib.sha256()
    _add_suite(digest, suite)
    for name in sorted(digests):
        digest.update(name.encode() + b"\0" + digests[name])
    return f"sha256:{digest.hexdigest()}"


def parquet_files(path: str | Path) -> list[Path]:
    """The Parquet file `path`, or the `*.parquet` files of directory `path`, sorted."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.parquet") if p.is_file())
        if not files:
            raise DataError(f"{path} holds no .parquet files; expected train/validation/test.parquet")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"{path} does not exist; pass a Parquet file or a directory of them")


def read_table(path: str | Path) -> pd.DataFrame:
    """Read one Parquet file as a pandas DataFrame, turning every kind of unreadable file into DataError."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist or is not a file")
    return parse_table(path, read_regular(path))


def parse_table(path: str | Path, data: bytes) -> pd.DataFrame:
    """The Parquet file `path` whose bytes are `data` (already read) as a DataFrame; DataError when unreadable."""
    import pyarrow as pa

    if not data:
        raise DataError(f"{path} is empty (0 bytes), not a Parquet file")
    try:
        return pd.read_parquet(pa.BufferReader(data))
    except Exception as err:  # pyarrow raises several unrelated types for truncated or foreign files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{path} is not a readable Parquet file (truncated or not Parquet): {reason}") \
            from err


def read_tables(path: str | Path, suite: str | Path = SUITE) -> tuple[str, list[tuple[Path, pd.DataFrame]]]:
    """Each Parquet file of `path` as a DataFrame, and the `fingerprint` of exactly the bytes parsed.

    Each file is read once: its bytes are hashed and parsed from the same buffer, so a file rewritten while
    it is read cannot pass validation under another content's fingerprint.
    """
    digests: dict[str, bytes] = {}
    frames: list[tuple[Path, pd.DataFrame]] = []
    for file in parquet_files(path):
        data = read_regular(file)
        digests[file.name] = hashlib.sha256(data).digest()
        frames.append((file, parse_table(file, data)))
        del data
    return fingerprint_of(digests, suite), frames


def quiet_gx_logging() -> None:
    """Keep GX's warnings and errors, not its INFO chatter; imports GX (its import is what logs first).

    Also the place GX is first imported from here: its analytics are turned off before that.
    """
    settings.no_telemetry()
    for name in QUIET_GX_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    import great_expectations.data_context.types.base  # noqa: F401

    logging.getLogger(GX_LOGGER_AT_INFO).setLevel(logging.WARNING)


def disable_progress_bars(context: Any) -> None:
    """No tqdm bars from this GX context: they go to stderr, which Airflow's task supervisor logs at ERROR.

    GX 1.x reads `progress_bars` from the context's config (`globally: false`, as `progress_bars:` in
    great_expectations.yml); it passes `disable=` to tqdm itself, so tqdm's TQDM_DISABLE does not help.
    """
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context.variables.progress_bars = ProgressBarsConfig(globally=False)


def _context(site_dir: Path) -> Any:
    quiet_gx_logging()
    import great_expectations as gx

    context = gx.get_context(mode="ephemeral")
    disable_progress_bars(context)
    site_dir.mkdir(parents=True, exist_ok=True)
    context.add_data_docs_site(
        site_name=DOCS_SITE,
        site_config={
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(site_dir)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )
    return context


def _run(
    context: Any, frame: pd.DataFrame, suite: gx.ExpectationSuite, result_format: str, name: str
) -> tuple[Any, Any]:
    import great_expectations as gx

    run_name = f"{name}-{result_format.lower()}"
    source = context.data_sources.add_or_update_pandas(name=SUITE)
    asset = source.add_dataframe_asset(name=run_name)
    batch = asset.add_batch_definition_whole_dataframe("whole")
    definition = context.validation_definitions.add_or_update(
        gx.ValidationDefinition(name=run_name, data=batch, suite=suite)
    )
    checkpoint = gx.Checkpoint(
        name=run_name,
        validation_definitions=[definition],
        actions=[],
        result_format={"result_format": result_format, "partial_unexpected_count": SAMPLE_SIZE},
    )
    result = checkpoint.run(batch_parameters={"dataframe": frame})
    ((identifier, validation),) = result.run_results.items()
    return identifier, validation


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in list(value.items())[:4]}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


def _failures(validation: ExpectationSuiteValidationResult) -> list[ExpectationFailure]:
    failures: list[ExpectationFailure] = []
    for result in validation.results:
        if result.success:
            continue
        config = result.expectation_config
        kwargs = dict(config.kwargs) if config else {}
        details = dict(result.result or {})
        name = config.type if config else "unknown"
        rule = str((config.meta or {}).get("rule", "")) if config else ""
        observed = details.get("observed_value")
        extra = details.get("details")
        raised = _raised(result.exception_info)
        if raised is not None:
            observed = f"error: {raised}"
        elif isinstance(extra, dict) and isinstance(extra.get("columns"), dict):
            # A wide expectation (nightshift/data/expectations.py): one failure per failing column.
            failures.extend(_column_failure(name, rule, str(column), found)
                            for column, found in extra["columns"].items())
            continue
        elif extra:
            # e.g. the column-set check: its `mismatched` details say more than the full column list
            observed = extra
        column = kwargs.get("column")
        failures.append(
            ExpectationFailure(
                expectation=name,
                column=str(column) if column is not None else None,
                rule=rule,
                unexpected_count=details.get("unexpected_count"),
                sample=_jsonable(list(details.get("partial_unexpected_list") or [])[:SAMPLE_SIZE]),
                observed=_jsonable(observed),
            )
        )
    return failures


def _raised(info: Any) -> str | None:
    """The first line of what an expectation raised, else None. GX puts it in `exception_info` directly, or
    (a metric that failed to compute, e.g. a column the table lacks) in a dict per metric."""
    if not isinstance(info, dict):
        return None
    for found in (info, *(v for v in info.values() if isinstance(v, dict))):
        if found.get("raised_exception"):
            lines = str(found.get("exception_message") or "").strip().splitlines()
            return lines[0] if lines else "the expectation raised"
    return None


def _column_failure(expectation: str, rule: str, column: str, found: dict[str, Any]) -> ExpectationFailure:
    return ExpectationFailure(
        expectation=expectation,
        column=column,
        rule=rule,
        unexpected_count=found.get("unexpected_count"),
        sample=_jsonable(list(found.get("partial_unexpected_list") or [])[:SAMPLE_SIZE]),
        observed=_jsonable(found.get("observed_value")),
    )


SHARED_STATIC = ".static"  # data_docs/.static/<sha256>: one copy of each of GX's static assets for every site


def share_static(site_dir: Path) -> None:
    """Make each file of the site's `static/` a hard link to the one copy of its content under
    data_docs/.static/: GX copies ~4 MB of fonts and images into every site, and every validation that writes
    a page has a site of its own (each night of refused data cost 4.2 MB). Each site keeps its own paths.
    A file that cannot be linked (another filesystem, a race) stays a copy: that costs disk, never a page."""
    store = data_docs_dir() / SHARED_STATIC
    for path in sorted((site_dir / "static").rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            shared = store / digest
            store.mkdir(parents=True, exist_ok=True)
            # A copy is trusted only while it holds the content it is named by: GX writes a site's static files in
            # place (open "wb"), so a build run again on a linked site, or an edit, changes the shared copy too;
            # the next sites then get a copy of their own content, never the changed bytes.
            if shared.is_file() and hashlib.sha256(shared.read_bytes()).hexdigest() == digest:
                source, target = shared, path
            else:
                source, target = path, shared
            temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
            os.link(source, temporary)
            os.replace(temporary, target)
        except OSError:
            continue


def _docs_page(context: Any, identifier: Any) -> str | None:
    context.build_data_docs(site_names=[DOCS_SITE], resource_identifiers=[identifier], build_index=True)
    urls = context.get_docs_sites_urls(resource_identifier=identifier, site_name=DOCS_SITE)
    url = urls[0].get("site_url") if urls else None
    return url.removeprefix("file://") if url else None


def validate_frame(
    frame: pd.DataFrame,
    suite: gx.ExpectationSuite | None = None,
    data_docs: DataDocs = True,
    *,
    context: Any = None,
    name: str = "table",
) -> tuple[bool, list[ExpectationFailure], str | None]:
    """Run the suite on one table: (success, failures with samples, Data Docs page or None).

    `data_docs`: True builds the table's page, "failed" only when the table fails, False never.
    `context` (from one `check_data` run) lets several tables share one Data Docs site; `name`
    must then differ per table.
    """
    suite = suite if suite is not None else load_suite()
    context = context if context is not None else _context(_new_site_dir())
    identifier, validation = _run(context, frame, suite, "BOOLEAN_ONLY", name)
    if not validation.success:
        identifier, validation = _run(context, frame, suite, "SUMMARY", name)
    failures = _failures(validation) if not validation.success else []
    wanted = data_docs is True or (data_docs == "failed" and not validation.success)
    page = _docs_page(context, identifier) if wanted else None
    return bool(validation.success), failures, page


def check_data(path: str | Path, data_docs: DataDocs = True, suite_file: str | Path | None = None,
               pipeline: str | None = None) -> ValidationReport:
    """Validate a Parquet file or each Parquet file of a directory; report, never raise on failed rules.

    `suite_file`: a suite JSON file (a pipeline's, or one `nightshift suite init` wrote) instead of gx/'s.
    `pipeline`: the DAG id whose run validates; its Data Docs then lie under `pipelines/<dag_id>/`, which the
    plugin serves only to those who may read that DAG's runs.
    Raises DataError when the input is missing or unreadable.
    """
    files = parquet_files(path)
    frames = [(file, read_table(file)) for file in files]  # read all first: unreadable input fails early
    return check_frames(path, frames, data_docs=data_docs, suite_file=suite_file, pipeline=pipeline)


def check_frames(path: str | Path, frames: Sequence[tuple[Path, pd.DataFrame]], data_docs: DataDocs = True,
                 suite_file: str | Path | None = None, pipeline: str | None = None) -> ValidationReport:
    """`check_data` of tables already read (`read_tables`): each (file, frame) against the suite, in one GX
    context whose Data Docs site is this run's own (`data_docs` as `validate_frame`'s; a site no page was
    written to is removed)."""
    suite = load_suite_file(suite_file) if suite_file is not None else load_suite()
    site_dir = _new_site_dir(pipeline)
    context = _context(site_dir)
    reports: list[FileReport] = []
    try:
        for file, frame in frames:
            if frame.empty:  # every column rule passes on no rows: an empty split is refused whatever the suite
                raise DataError(f"{file} has {len(frame)} rows and {len(frame.columns)} columns: an empty split is "
                                f"nothing to train or evaluate on; check what wrote it")
            success, failures, page = validate_frame(frame, suite, data_docs=data_docs, context=context,
                                                     name=file.stem)
            reports.append(FileReport(path=str(file), rows=len(frame), success=success, failures=failures,
                                      data_docs=page))
    finally:
        if not any(r["data_docs"] for r in reports):
            shutil.rmtree(site_dir, ignore_errors=True)  # this run's own folder (a timestamp and a random id)
        else:
            share_static(site_dir)
    return ValidationReport(path=str(path), suite=suite.name, success=all(r["success"] for r in reports),
                            files=reports)


def describe_failures(report: ValidationReport) -> str:
    """One line naming each failed expectation with sample unexpected values and the Data Docs pages."""
    parts: list[str] = []
    pages: list[str] = []
    total = 0
    for file in report["files"]:
        if file["success"]:
            continue
        if file["data_docs"]:
            pages.append(file["data_docs"])
        for failure in file["failures"]:
            total += 1
            if len(parts) >= SUMMARY_FAILURES:
                continue
            target = f"({failure['column']})" if failure["column"] else ""
            evidence = f"e.g. {failure['sample']}" if failure["sample"] else f"observed {failure['observed']}"
            parts.append(f"{Path(file['path']).name}: {failure['expectation']}{target} "
                         f"[{failure['rule']}] {evidence}")
    more = f"; and {total - len(parts)} more" if total > len(parts) else ""
    docs = f"; Data Docs: {', '.join(pages)}" if pages else ""
    return (f"{report['path']} failed {total} expectation(s) of suite {report['suite']!r}: "
            f"{'; '.join(parts)}{more}{docs}")


def validate_data(path: str | Path, suite_file: str | Path | None = None) -> ValidationReport:
    """Validate `path` (a Parquet file or a directory of them) with `suite_file` (else gx/'s suite) and return
    the report as a dict.

    Raises DataValidationFailed naming each failed expectation with sample unexpected values, and
    DataError when the input is missing or unreadable.
    """
    report = check_data(path, suite_file=suite_file)
    if not report["success"]:
        raise DataValidationFailed(describe_failures(report))
    return report
