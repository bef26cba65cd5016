"""Strict validation of the custom resources Nightshift builds, against the CRDs their projects publish.

The CRD schemas (MPIJob, Kueue v1beta2, KServe InferenceService) are read from a schemas folder
(`NIGHTSHIFT_SCHEMAS`, else `../shared/schemas` beside the repository), never copied into the project.
The published CRDs allow unknown fields, so a misspelt field (`slotsPerWorkerr`) would pass; `strict`
forbids them wherever a schema lists the known properties, as an API server with `fieldValidation=Strict`
does. CEL rules (`x-kubernetes-validations`) are not evaluated here.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# (apiVersion, kind) -> (CRD file, version name in spec.versions)
CRDS: dict[tuple[str, str], tuple[str, str]] = {
    ("kubeflow.org/v2beta1", "MPIJob"): ("kubeflow.org_mpijobs.yaml", "v2beta1"),
    ("serving.kserve.io/v1beta1", "InferenceService"): ("serving.kserve.io_inferenceservices.yaml", "v1beta1"),
    **{("kueue.x-k8s.io/v1beta2", kind): (f"kueue.x-k8s.io_{plural}.yaml", "v1beta2")
       for kind, plural in (("ClusterQueue", "clusterqueues"), ("LocalQueue", "localqueues"),
                            ("ResourceFlavor", "resourceflavors"), ("Workload", "workloads"),
                            ("WorkloadPriorityClass", "workloadpriorityclasses"), ("Topology", "topologies"))},
}


class ManifestInvalid(ValueError):
    """A built object does not validate against its CRD; the message names the object, field and reason."""


def schemas_dir() -> Path | None:
    """Where the published CRDs are: NIGHTSHIFT_SCHEMAS, else ../shared/schemas beside the repository."""
    configured = os.environ.get("NIGHTSHIFT_SCHEMAS")
    path = Path(configured) if configured else REPO.parent / "shared" / "schemas"
    return path if path.is_dir() else None


def strict(schema: Any) -> Any:
    """The schema with unknown fields forbidden wherever it lists the known ones.

    An object schema that declares `properties` and neither `additionalProperties` nor
    `x-kubernetes-preserve-unknown-fields` accepts nothing else.
    """
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_schema(filename: str, version: str, directory: Path) -> dict[str, Any]:
    """The openAPIV3Schema of `version` (picked by name, not position) in the CRD `filename`."""
    import yaml

    crd = yaml.safe_load((directory / filename).read_text())
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return dict(entry["schema"]["openAPIV3Schema"])
    raise ManifestInvalid(f"{filename} has no version {version!r}")


@cache
def _validator(filename: str, version: str, directory: Path) -> Any:
    import jsonschema

    schema = strict(crd_schema(filename, version, directory))
    return jsonschema.validators.validator_for(schema)(schema)


def validate(obj: dict[str, Any], directory: Path | None = None) -> bool:
    """Validate `obj` strictly against its CRD; False when no schema for it is at hand (nothing checked)."""
    import jsonschema

    key = (str(obj.get("apiVersion")), str(obj.get("kind")))
    directory = directory or schemas_dir()
    if key not in CRDS or directory is None or not (directory / CRDS[key][0]).exists():
        return False
    try:
        _validator(*CRDS[key], directory).validate(obj)
    except jsonschema.ValidationError as err:
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        name = (obj.get("metadata") or {}).get("name", "?")
        raise ManifestInvalid(f"{key[1]} {name} does not validate against {CRDS[key][0]} ({CRDS[key][1]}): "
                              f"{where}: {err.message}") from err
    return True
