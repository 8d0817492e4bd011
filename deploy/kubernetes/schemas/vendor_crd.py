"""Turns a CustomResourceDefinition's published openAPIV3Schema into the JSON Schema that
deploy/kubernetes/validate.py checks manifests against (offline, no cluster).

    python deploy/kubernetes/schemas/vendor_crd.py CRD.yaml VERSION OUT.json \
        [--pod-template PROPERTY ...] [--source TEXT]

What changes on the way (kept small on purpose, the CRD's own constraints stay as they are):
- descriptions are dropped (the CRD is the documentation);
- objects that list `properties` and neither preserve unknown fields nor take
  `additionalProperties` get `additionalProperties: false`, as the API server's strict field
  validation (kubectl's default since 1.27) rejects unknown fields;
- `apiVersion` and `kind` are pinned to the CRD's group/version and kind, `metadata` refers to
  the core ObjectMeta;
- properties named by --pod-template (LeaderWorkerSet's leaderTemplate / workerTemplate) refer
  to the core PodTemplateSpec of kubernetes-validate's schemas instead of the CRD's copy of it,
  so pods inside a custom resource are checked as strictly as a Deployment's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

CORE_DEFINITIONS = "https://kubernetes.io/api/_definitions.json#/$defs/"
"""How kubernetes-validate's schemas refer to the core types (its `_definitions.json`)."""


def strict(node: Any, pod_templates: frozenset[str]) -> Any:
    """`node` without descriptions, closed to unknown fields, pod templates as references."""
    if isinstance(node, list):
        return [strict(item, pod_templates) for item in node]
    if not isinstance(node, dict):
        return node
    skip = ("description", "properties")
    out = {key: strict(value, pod_templates) for key, value in node.items() if key not in skip}
    if "properties" in node:
        out["properties"] = {
            name: (
                {"$ref": CORE_DEFINITIONS + "io.k8s.api.core.v1.PodTemplateSpec"}
                if name in pod_templates
                else strict(value, pod_templates)
            )
            for name, value in node["properties"].items()
        }
        preserves = node.get("x-kubernetes-preserve-unknown-fields", False)
        if not preserves and "additionalProperties" not in node:
            out["additionalProperties"] = False
    return out


def crd_schema(crd: dict, version: str, pod_templates: frozenset[str], source: str) -> dict:
    """The JSON Schema of one served version of `crd`."""
    names = crd["spec"]["names"]
    api_version = f"{crd['spec']['group']}/{version}"
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    if version not in served:
        raise SystemExit(f"version {version!r} not in the CRD; it has {sorted(served)}")
    schema = strict(served[version]["schema"]["openAPIV3Schema"], pod_templates)
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [api_version]}
    schema["properties"]["kind"] = {"type": "string", "enum": [names["kind"]]}
    schema["properties"]["metadata"] = {
        "$ref": CORE_DEFINITIONS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    }
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    schema["$comment"] = source
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crd", help="the CRD's YAML (as its project publishes it)")
    parser.add_argument("version", help="the served version to take, e.g. v1")
    parser.add_argument("out", help="the JSON Schema to write")
    parser.add_argument("--pod-template", action="append", default=[], help="property name")
    parser.add_argument("--source", default="", help="where the CRD came from (kept in $comment)")
    args = parser.parse_args()
    with open(args.crd, encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    schema = crd_schema(crd, args.version, frozenset(args.pod_template), args.source)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(schema, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
