"""Render a kustomization of deploy/kubernetes without a cluster and without kustomize, for CI's checks.

Only what these manifests use is understood: `resources` (YAML files, and folders holding a kustomization),
`namespace`, `replicas`, `patches` given inline as RFC 6902 operations with a `target` (kind, name, group, version),
and `secretGenerator` from files with `disableNameSuffixHash`. Anything else in a kustomization is refused, so
an overlay that grows a feature this renderer lacks fails here instead of rendering wrong;
tests/unit/test_kubernetes_manifests.py also compares the result with `kubectl kustomize` where kubectl is installed.

    python deploy/kubernetes/render.py deploy/kubernetes/overlays/colocated      # the manifests, as YAML
"""

from __future__ import annotations

import base64
import copy
import sys
from pathlib import Path

import jsonpatch
import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "replicas", "patches", "secretGenerator"}
# the kinds whose replica count `replicas:` sets (kustomize's own list)
SCALABLE_KINDS = {"Deployment", "ReplicaSet", "ReplicationController", "StatefulSet"}
# the kinds these manifests use that live outside any namespace
CLUSTER_SCOPED_KINDS = {"Namespace", "PersistentVolume", "StorageClass", "CustomResourceDefinition", "ClusterRole"}


class KustomizeError(ValueError):
    pass


def render(directory: str | Path) -> list[dict]:
    """The resources the kustomization in `directory` makes, transformed as kustomize would."""
    directory = Path(directory)
    kustomization = _read_kustomization(directory)
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise KustomizeError(f"{directory}: fields this renderer does not support: {sorted(unknown)}")
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            resources += render(path)
        elif path.is_file():
            resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        else:
            raise KustomizeError(f"{directory}: resource {entry} not found")
    resources += [_secret(directory, spec) for spec in kustomization.get("secretGenerator", [])]
    _check_unique(resources, directory)
    if "namespace" in kustomization:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED_KINDS:
                resource["metadata"]["namespace"] = kustomization["namespace"]
    for patch in kustomization.get("patches", []):
        resources = [_patched(resource, patch, directory) for resource in resources]
    for replicas in kustomization.get("replicas", []):
        _set_replicas(resources, replicas, directory)
    return resources


def _read_kustomization(directory: Path) -> dict:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return yaml.safe_load((directory / name).read_text()) or {}
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def _secret(directory: Path, spec: dict) -> dict:
    if set(spec) - {"name", "files", "options", "type"} or not spec.get("options", {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"{directory}: secretGenerator {spec.get('name')}: only files with disableNameSuffixHash")
    data = {}
    for entry in spec["files"]:
        key, _, file = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
        path = directory / file
        if not path.is_file():
            raise KustomizeError(f"{directory}: secretGenerator {spec['name']}: {file} not found")
        data[key] = base64.b64encode(path.read_bytes()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": spec["name"]},
        "type": spec.get("type", "Opaque"),
        "data": data,
    }


def _check_unique(resources: list[dict], directory: Path) -> None:
    seen = set()
    for resource in resources:
        key = (resource["kind"], resource["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{directory}: {key[0]} {key[1]} is defined twice")
        seen.add(key)


def _matches(resource: dict, target: dict) -> bool:
    group, _, version = resource["apiVersion"].rpartition("/")
    unknown = set(target) - {"kind", "name", "group", "version"}
    if unknown:
        raise KustomizeError(f"patch target selects by {sorted(unknown)}: not supported")
    actual = {"kind": resource["kind"], "name": resource["metadata"]["name"], "group": group, "version": version}
    return all(actual[key] == value for key, value in target.items())


def _patched(resource: dict, patch: dict, directory: Path) -> dict:
    if set(patch) != {"target", "patch"}:
        raise KustomizeError(f"{directory}: a patch needs exactly target and an inline patch, got {sorted(patch)}")
    if not _matches(resource, patch["target"]):
        return resource
    operations = yaml.safe_load(patch["patch"])
    if not isinstance(operations, list):
        raise KustomizeError(f"{directory}: only RFC 6902 patches (a list of operations) are supported")
    try:
        return jsonpatch.apply_patch(copy.deepcopy(resource), operations)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
        name = f"{resource['kind']} {resource['metadata']['name']}"
        raise KustomizeError(f"{directory}: patch of {name}: {e}") from None


def _set_replicas(resources: list[dict], replicas: dict, directory: Path) -> None:
    hits = [r for r in resources if r["kind"] in SCALABLE_KINDS and r["metadata"]["name"] == replicas["name"]]
    if not hits:
        raise KustomizeError(f"{directory}: replicas: no Deployment or StatefulSet named {replicas['name']}")
    for resource in hits:
        resource["spec"]["replicas"] = replicas["count"]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    yaml.safe_dump_all(render(sys.argv[1]), sys.stdout, sort_keys=False)
