"""Pipelines as data: one YAML declaration per retraining pipeline, validated against the published schema
(`pipeline.schema.json`, next to this file), read into a `Pipeline` a DAG factory builds one DAG from.

    pipelines, problems = load_pipelines("pipelines/")   # the good ones, and one error per bad file
    pipeline = load_pipeline("pipelines/digits.yaml")     # or PipelineInvalid naming file, key and fix
    check_against_data(pipeline)                          # [] or one line per mismatch with the data
"""

from __future__ import annotations

from nightshift.pipelines.check import check_against_data, check_declaration
from nightshift.pipelines.load import (
    SCHEMA_PATH,
    PipelineInvalid,
    check_unique,
    clashes,
    declaration_files,
    declaration_folders,
    load_pipeline,
    load_pipelines,
    schema,
)
from nightshift.pipelines.spec import (
    DataLocation,
    DatasetSpec,
    DeploySpec,
    GateSpec,
    ModelSpec,
    Pipeline,
    TrainingSpec,
)

__all__ = [
    "SCHEMA_PATH",
    "DataLocation",
    "DatasetSpec",
    "DeploySpec",
    "GateSpec",
    "ModelSpec",
    "Pipeline",
    "PipelineInvalid",
    "TrainingSpec",
    "check_against_data",
    "check_declaration",
    "check_unique",
    "clashes",
    "declaration_files",
    "declaration_folders",
    "load_pipeline",
    "load_pipelines",
    "schema",
]
