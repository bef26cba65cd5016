from __future__ import annotations

from pathlib import Path

import pytest

from nightshift import settings
from nightshift.errors import UsageError


def test_data_sources_must_lie_under_the_data_roots(nightshift_home: Path, tmp_path: Path) -> None:
    inside = nightshift_home / "data" / "nightly"
    inside.mkdir(parents=True)
    assert settings.confined_data_source(str(inside)) == inside.resolve()
    assert settings.confined_data_source(nightshift_home / "demo-data" / "digits").is_relative_to(nightshift_home)
    for outside in ("/etc", str(nightshift_home / "data" / ".." / "mlflow.db"), str(tmp_path)):
        with pytest.raises(UsageError, match=r"outside the allowed data roots \(.*/demo-data, .*/data\)"):
            settings.confined_data_source(outside)


def test_a_symlink_inside_a_root_cannot_lead_out_of_it(nightshift_home: Path) -> None:
    link = nightshift_home / "data" / "escape"
    link.parent.mkdir(parents=True)
    link.symlink_to("/etc")
    with pytest.raises(UsageError, match="outside the allowed data roots"):
        settings.confined_data_source(link)


def test_a_file_symlinked_out_of_the_roots_is_refused(nightshift_home: Path, tmp_path: Path) -> None:
    """The directory lies under a root, one of its files is a link to a file outside every root (issue 20 item 15)."""
    data = nightshift_home / "data" / "nightly"
    data.mkdir(parents=True)
    (data / "validation.parquet").write_bytes(b"inside")
    secret = tmp_path / "secret.parquet"
    secret.write_bytes(b"outside")
    (data / "train.parquet").symlink_to(secret)
    with pytest.raises(UsageError, match=r"train\.parquet is a link to .*secret\.parquet, outside the allowed data "
                                         r"roots \(.*/demo-data, .*/data\)"):
        settings.confined_data_source(data)
    (data / "train.parquet").unlink()
    shared = nightshift_home / "data" / "shared" / "train.parquet"
    shared.parent.mkdir()
    shared.write_bytes(b"inside too")
    (data / "train.parquet").symlink_to(shared)  # a link that stays under the roots is fine
    assert settings.confined_data_source(data) == data.resolve()
    (data / "nested").mkdir()
    (data / "nested" / "x.parquet").symlink_to("/etc/hostname")  # links in subdirectories count too
    with pytest.raises(UsageError, match=r"nested/x\.parquet is a link to /etc/hostname"):
        settings.confined_data_source(data)


def test_the_roots_are_configurable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NIGHTSHIFT_DATA_ROOTS", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert settings.confined_data_source(tmp_path / "b" / "x") == (tmp_path / "b" / "x").resolve()
    with pytest.raises(UsageError, match="NIGHTSHIFT_DATA_ROOTS"):
        settings.confined_data_source(tmp_path / "c")


def test_importing_the_library_changes_no_environment_variable() -> None:
    import os
    import subprocess
    import sys

    code = ("import os, json; before = dict(os.environ)\n"
            "import nightshift.data.validate, nightshift.data.stage, nightshift.tracking\n"
            "print(json.dumps(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))))")
    env = {k: v for k, v in os.environ.items() if k not in settings.NO_TELEMETRY}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_telemetry_opt_outs_respect_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in settings.NO_TELEMETRY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DO_NOT_TRACK", "0")
    settings.no_telemetry()
    import os

    assert os.environ["GX_ANALYTICS_ENABLED"] == "false" and os.environ["DVC_NO_ANALYTICS"] == "1"
    assert os.environ["DO_NOT_TRACK"] == "0"


def test_a_pipelines_data_docs_lie_in_its_own_folder(nightshift_home: Path) -> None:
    from nightshift.data.validate import _new_site_dir
    from nightshift.errors import DagIdInvalid

    docs = nightshift_home / "gx" / "data_docs"
    assert _new_site_dir("churn_model").parent == docs / "pipelines" / "churn_model"  # the plugin asks its readers
    assert _new_site_dir().parent == docs  # `nightshift validate`'s pages: no owner
    with pytest.raises(DagIdInvalid):
        settings.pipeline_data_docs_dir("../gx")


def test_a_refused_data_source_is_named_without_the_credentials_it_carries(nightshift_home: Path,
                                                                          tmp_path: Path) -> None:
    """issue 37 review: a data_source typed as a URL with a key in it was echoed whole into the gate's failure
    (the task log); the refusal names it with the credentials masked."""
    from nightshift.errors import UsageError
    from nightshift.settings import confined_data_source

    with pytest.raises(UsageError, match="outside the allowed data roots") as caught:
        confined_data_source("s3://AKIAEXAMPLE:topsecret@bucket/data", [tmp_path])
    assert "topsecret" not in str(caught.value) and "bucket/data" in str(caught.value)
