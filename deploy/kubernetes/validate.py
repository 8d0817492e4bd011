"""Validates every manifest under deploy/kubernetes/ offline: no cluster, no network.

    python deploy/kubernetes/validate.py        one line per object; exit 1 on any error

Core kinds (Deployment, Service, HorizontalPodAutoscaler, ConfigMap, NetworkPolicy, ...) are
checked against the Kubernetes schemas that the `kubernetes-validate` package carries
(strict: an unknown field is an error, as `kubectl apply` rejects it); LeaderWorkerSet and
KEDA's ScaledObject against their CRDs' schemas vendored in schemas/ (see schemas/README.md),
whose pod templates refer to the same core schemas.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

HERE = Path(__file__).resolve().parent
SCHEMAS = HERE / "schemas"
KUBERNETES_VERSION = "1.33"
"""The Kubernetes release the manifests are checked against (the preStop `sleep` action they
use is on by default since 1.30; LeaderWorkerSet 0.10 and KEDA 2.20 support it)."""
CRD_SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-"
    "leaderworkerset.x-k8s.io-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
}
"""(apiVersion, kind) -> its schema in schemas/ (vendor_crd.py's output)."""


@dataclass(frozen=True)
class Manifest:
    """One object of a manifest file."""

    path: Path
    doc: dict

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(HERE)}: {self.doc['kind']}/{self.doc['metadata']['name']}"


def manifest_files() -> list[Path]:
    """Every YAML file of deploy/kubernetes/ (the schemas folder holds JSON only)."""
    return sorted(p for p in HERE.rglob("*.yaml") if SCHEMAS not in p.parents)


def load_manifests() -> list[Manifest]:
    """Every object of every manifest file, in file order (empty documents skipped)."""
    manifests = []
    for path in manifest_files():
        with open(path, encoding="utf-8") as f:
            manifests += [Manifest(path, doc) for doc in yaml.safe_load_all(f) if doc]
    return manifests


def validate(doc: dict) -> None:
    """Raises jsonschema.ValidationError (or kubernetes_validate's errors) unless `doc` is a
    valid object of its kind."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        crd_validator(CRD_SCHEMAS[key]).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@cache
def crd_validator(filename: str) -> jsonschema.Draft202012Validator:
    """A validator for a vendored CRD schema, its references resolved in the core schemas."""
    with open(SCHEMAS / filename, encoding="utf-8") as f:
        schema = json.load(f)
    registry = Resource.from_contents(core_definitions()) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def core_definitions() -> dict:
    """kubernetes-validate's shared core definitions for KUBERNETES_VERSION, strict."""
    folder = f"v{KUBERNETES_VERSION}.0-local-strict"
    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / folder
    with open(path / "_definitions.json", encoding="utf-8") as f:
        return json.load(f)


def main() -> int:
    failures = 0
    for manifest in load_manifests():
        try:
            validate(manifest.doc)
            print(f"ok    {manifest.name}")
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            failures += 1
            where = ".".join(str(part) for part in exc.path)
            print(f"ERROR {manifest.name}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures += 1
            print(f"ERROR {manifest.name}: {exc.message}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
