"""A tiny kustomize: resources, namespace and strategic-merge patches, enough for deploy/k8s.

No kustomize binary runs here; this renders what ``kubectl kustomize`` would for the subset of
features our kustomizations use, and fails loudly on any feature it does not know, so a new
feature in a kustomization cannot pass the tests unrendered.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches"}
# Lists merged by a key, as Kubernetes' strategic merge patch does for these fields.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
    "volumeMounts": "mountPath", "ports": "containerPort", "tolerations": "key",
}


def load_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document in ``path``."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base: Any, patch: Any, field: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            for index, existing in enumerate(out_list):
                if existing.get(key) == item.get(key):
                    out_list[index] = _merge(existing, item, None)
                    break
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def render(directory: Path) -> list[dict[str, Any]]:
    """Render the kustomization in ``directory`` into a list of resources."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_KEYS
    if unknown:
        raise NotImplementedError(f"kustomize_lite does not support {sorted(unknown)}")
    resources: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        target = directory / entry
        resources.extend(render(target) if target.is_dir() else load_documents(target))
    for entry in kustomization.get("patches", []):
        if set(entry) != {"path"}:
            raise NotImplementedError(f"kustomize_lite supports only patches[].path: {entry}")
        for patch in load_documents(directory / entry["path"]):
            matches = [
                i for i, r in enumerate(resources)
                if (r["apiVersion"], r["kind"], r["metadata"]["name"])
                == (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
            ]
            if len(matches) != 1:
                raise LookupError(f"patch {entry['path']} matches {len(matches)} resources")
            resources[matches[0]] = _merge(resources[matches[0]], patch)
    if "namespace" in kustomization:
        for resource in resources:
            resource.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    return resources
