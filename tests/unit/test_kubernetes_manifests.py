"""deploy/kubernetes, checked without a cluster: every overlay is rendered (deploy/kubernetes/render.py, compared
with `kubectl kustomize` where kubectl is installed), every manifest validated against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail) and LeaderWorkerSets against their API's schema (the pod
templates inside against Kubernetes' PodTemplateSpec), every container's command parsed by the real `deltamesh`
CLI, and the wiring checked: how workers find the router and what they advertise, probes on the ports the
processes serve, the mesh secret and the checkpoints mounted from objects the overlay makes, GPUs per worker."""

from __future__ import annotations

import base64
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml

from deltamesh.services.cli import app

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())
# gRPC probes are GA from 1.27; the oldest release still supported upstream and the newest the package knows
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
WORKER_ROLES = {"prefill", "decode", "colocated"}
SECRET = "k8s-test-mesh-secret-0123456789abcdef"
IMAGE_USER = 10001  # the Dockerfile's `deltamesh` user

_spec = importlib.util.spec_from_file_location("kustomize_render", KUBERNETES / "render.py")
render_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_module)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of deploy/kubernetes with the mesh secret file the user makes before the first apply."""
    copy = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(KUBERNETES, copy, ignore=shutil.ignore_patterns("mesh-secret", "__pycache__"))
    (copy / "base" / "mesh-secret").write_text(SECRET + "\n")
    return copy


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, list[dict]]:
    return {overlay: render_module.render(tree / "overlays" / overlay) for overlay in OVERLAYS}


def by_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def pod_templates(resources: list[dict]) -> list[tuple[str, dict]]:
    """(owner name, pod template) of every workload."""
    out = []
    for r in resources:
        if r["kind"] in {"Deployment", "StatefulSet"}:
            out.append((r["metadata"]["name"], r["spec"]["template"]))
        elif r["kind"] == "LeaderWorkerSet":
            lwt = r["spec"]["leaderWorkerTemplate"]
            out += [(r["metadata"]["name"], lwt[t]) for t in ("leaderTemplate", "workerTemplate") if t in lwt]
    return out


def cli_params(argv: list[str]) -> dict:
    """The subcommand's parameters as the real CLI parses argv (UsageError on a bad invocation)."""
    group = typer.main.get_command(app)
    assert argv[0] in group.commands, f"no deltamesh command {argv[0]!r}"
    return dict(group.commands[argv[0]].make_context(argv[0], list(argv[1:])).params)


def container_settings(container: dict, config: dict[str, str]) -> dict:
    """The container's command parsed with the environment it gets (the ConfigMap and its own env values), as
    the process would see it. Values from the downward API are given a placeholder IP."""
    env = dict(config)
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", "10.0.0.7" if "valueFrom" in e else "")
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("DELTAMESH_")}
    try:
        os.environ.update({k: v for k, v in env.items() if k.startswith("DELTAMESH_")})
        return cli_params(container["args"])
    finally:
        for k in env:
            if k.startswith("DELTAMESH_"):
                os.environ.pop(k, None)
        os.environ.update(saved)


def test_every_layout_has_a_router_and_workers_of_each_role(rendered):
    expected = {
        "colocated": {"colocated"},
        "xpyd-one-node": {"prefill", "decode"},
        "xpyd-multi-node": {"prefill", "decode"},
    }
    assert set(OVERLAYS) == set(expected)
    for overlay, resources in rendered.items():
        roles = {t["spec"]["containers"][0]["args"][0] for _, t in pod_templates(resources)}
        assert roles == {"router"} | expected[overlay], f"{overlay}: roles {roles}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_kubernetes(rendered, version):
    for overlay, resources in rendered.items():
        for r in resources:
            if r["kind"] == "LeaderWorkerSet":
                continue  # not a built-in kind: its own schema below
            try:
                kubernetes_validate.validate(r, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{overlay}: {r['kind']} {r['metadata']['name']} (Kubernetes {version}): {e}")


def lws_schemas() -> list[tuple[str, dict]]:
    """The schema written from the LWS API reference; and the CRD's own where one is given."""
    out = [("API reference", yaml.safe_load((KUBERNETES / "schemas" / "leaderworkerset-v1.yaml").read_text()))]
    candidates = [os.environ.get("DELTAMESH_LWS_CRD", "")] + [
        str(p / "shared" / "vendor" / "lws" / "leaderworkersets.yaml") for p in (ROOT.parent, ROOT.parent.parent)
    ]
    for path in filter(None, candidates):
        if Path(path).is_file():
            crd = yaml.safe_load(Path(path).read_text())
            (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            out.append((f"CRD {path}", version["schema"]["openAPIV3Schema"]))
            break
    return out


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_leaderworkersets_match_their_schema_and_their_pods_kubernetes(rendered, version):
    checked = 0
    for overlay, resources in rendered.items():
        for name, lws in by_kind(resources, "LeaderWorkerSet").items():
            for source, schema in lws_schemas():
                try:
                    jsonschema.validate(lws, schema)
                except jsonschema.ValidationError as e:
                    pytest.fail(
                        f"{overlay}: LeaderWorkerSet {name} against the {source}: {e.message} at {list(e.path)}"
                    )
            for _, template in pod_templates([lws]):
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}}
                try:
                    kubernetes_validate.validate({**pod_template, "template": template}, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    pytest.fail(f"{overlay}: LeaderWorkerSet {name}'s pod template (Kubernetes {version}): {e}")
            checked += 1
    assert checked, "no LeaderWorkerSet in any overlay"


def test_the_lws_schema_refuses_what_the_api_refuses(rendered):
    (_, schema), *_ = lws_schemas()
    lws = next(iter(by_kind(rendered["xpyd-multi-node"], "LeaderWorkerSet").values()))
    for path, bad in [
        (("spec", "leaderWorkerTemplate", "size"), 0),
        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Always"),
        (("spec", "startupPolicy"), "WhenReady"),
        (("spec", "leaderWorkerTemplate", "sizee"), 2),
    ]:
        broken = yaml.safe_load(yaml.safe_dump(lws))
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_every_command_and_variable_is_one_the_cli_takes(rendered):
    group = typer.main.get_command(app)
    for overlay, resources in rendered.items():
        config = by_kind(resources, "ConfigMap")["deltamesh-config"]["data"]
        for owner, template in pod_templates(resources):
            for c in template["spec"]["containers"]:
                command = group.commands[c["args"][0]]
                variables = {e["name"] for e in c.get("env", [])} | set(config)
                for var in (v for v in variables if v.startswith("DELTAMESH_")):
                    known = {p.name for p in command.params if var == f"DELTAMESH_{p.name.upper()}"}
                    assert known, f"{overlay}: {owner}: deltamesh {c['args'][0]} takes no {var}"
                container_settings(c, config)  # raises on an unknown flag or a bad value


def test_workers_register_with_the_router_under_their_pod_ip(rendered):
    for overlay, resources in rendered.items():
        config = by_kind(resources, "ConfigMap")["deltamesh-config"]["data"]
        services = by_kind(resources, "Service")
        router = container_settings(
            by_kind(resources, "Deployment")["deltamesh-router"]["spec"]["template"]["spec"]["containers"][0], config
        )
        for owner, template in pod_templates(resources):
            (c,) = template["spec"]["containers"]
            if c["args"][0] not in WORKER_ROLES:
                continue
            params = container_settings(c, config)
            assert params["host"] == "0.0.0.0", f"{overlay}: {owner} must bind every interface of its pod"
            host, _, port = params["router"].rpartition(":")
            control = services[host]
            (service_port,) = [p for p in control["spec"]["ports"] if p["port"] == int(port)]
            target = service_port["targetPort"]
            router_ports = {
                p["name"]: p["containerPort"]
                for p in by_kind(resources, "Deployment")["deltamesh-router"]["spec"]["template"]["spec"]["containers"][
                    0
                ]["ports"]
            }
            assert router_ports.get(target, target) == router["control_port"], (
                f"{overlay}: {owner} does not reach the control plane"
            )
            assert control["spec"].get("publishNotReadyAddresses"), (
                f"{overlay}: the control Service must list the router before /ready (workers make it ready)"
            )
            advertise = {e["name"]: e for e in c["env"]}["DELTAMESH_ADVERTISE_HOST"]
            assert advertise["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, f"{overlay}: {owner}"
            # pods share no memory: without the interface the side channel reaches no other pod's worker
            assert params["side_channel_interface"] == "eth0", f"{overlay}: {owner}: the side channel stays in its pod"


def test_probes_metrics_and_ports_match_what_each_process_serves(rendered):
    for overlay, resources in rendered.items():
        config = by_kind(resources, "ConfigMap")["deltamesh-config"]["data"]
        for owner, template in pod_templates(resources):
            (c,) = template["spec"]["containers"]
            params = container_settings(c, config)
            named = {p["name"]: p["containerPort"] for p in c["ports"]}
            annotations = template["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
            if c["args"][0] == "router":
                assert named == {
                    "grpc": params["grpc_port"],
                    "control": params["control_port"],
                    "http": params["http_port"],
                }
                assert c["readinessProbe"]["httpGet"]["path"] == "/ready", f"{overlay}: router readiness"
                assert named[c["readinessProbe"]["httpGet"]["port"]] == params["http_port"]
                assert int(annotations["prometheus.io/port"]) == params["http_port"]
                continue
            assert named == {"grpc": params["port"], "metrics": params["metrics_port"]}, f"{overlay}: {owner} ports"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == params["port"], f"{overlay}: {owner} {probe} is not its gRPC port"
            assert int(annotations["prometheus.io/port"]) == params["metrics_port"], f"{overlay}: {owner} metrics"


def test_pods_mount_the_mesh_secret_and_the_checkpoints_the_overlay_provides(rendered):
    for overlay, resources in rendered.items():
        config = by_kind(resources, "ConfigMap")["deltamesh-config"]["data"]
        secrets, claims = by_kind(resources, "Secret"), by_kind(resources, "PersistentVolumeClaim")
        assert base64.b64decode(secrets["deltamesh-mesh-secret"]["data"]["mesh-secret"]).decode().strip() == SECRET
        for owner, template in pod_templates(resources):
            spec = template["spec"]
            (c,) = spec["containers"]
            params = container_settings(c, config)
            volumes = {v["name"]: v for v in spec["volumes"]}
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            secret_mount = mounts[str(Path(params["mesh_secret_file"]).parent)]
            assert secret_mount.get("readOnly"), f"{overlay}: {owner} mounts the mesh secret writable"
            secret_volume = volumes[secret_mount["name"]]["secret"]
            assert secret_volume["secretName"] in secrets, (
                f"{overlay}: {owner}: no Secret {secret_volume['secretName']}"
            )
            model_mount = next(m for path, m in mounts.items() if params["model"].startswith(path + "/"))
            assert model_mount.get("readOnly"), f"{overlay}: {owner} mounts the checkpoints writable"
            source = volumes[model_mount["name"]]
            if "persistentVolumeClaim" in source:
                claim = source["persistentVolumeClaim"]["claimName"]
                assert claim in claims and "ReadOnlyMany" in claims[claim]["spec"]["accessModes"], f"{overlay}: {claim}"
            else:
                assert source["hostPath"]["type"] == "Directory", f"{overlay}: {owner}: checkpoints from {source}"
            security = spec["securityContext"]
            assert security["runAsUser"] == IMAGE_USER and security["fsGroup"] == IMAGE_USER, (
                f"{overlay}: {owner}: the image's user must read the secret (fsGroup)"
            )


def test_each_worker_gets_the_gpus_its_ranks_use(rendered):
    for overlay, resources in rendered.items():
        config = by_kind(resources, "ConfigMap")["deltamesh-config"]["data"]
        for owner, template in pod_templates(resources):
            (c,) = template["spec"]["containers"]
            if c["args"][0] not in WORKER_ROLES:
                assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), f"{overlay}: the router needs no GPU"
                continue
            params = container_settings(c, config)
            ranks = params["tensor_parallel_size"] * params["data_parallel_size"]
            assert params["device"] == "cuda", f"{overlay}: {owner}"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == ranks, f"{overlay}: {owner}: {ranks} ranks"
            kind = next(r["kind"] for r in resources if r["metadata"]["name"] == owner)
            assert (kind == "LeaderWorkerSet") == (ranks > 1), f"{overlay}: {owner}: multi-GPU workers are LWS groups"


def test_services_select_pods_that_exist(rendered):
    for overlay, resources in rendered.items():
        labels = [t["metadata"]["labels"] for _, t in pod_templates(resources)]
        for name, service in by_kind(resources, "Service").items():
            selector = service["spec"]["selector"]
            assert any(selector.items() <= pod.items() for pod in labels), f"{overlay}: Service {name} selects nothing"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed")
def test_the_renderer_agrees_with_kubectl_kustomize(tree, rendered):
    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    for overlay in OVERLAYS:
        out = subprocess.run(
            ["kubectl", "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
        theirs = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=key)
        assert theirs == sorted(rendered[overlay], key=key), f"{overlay}: the renderer and kustomize differ"


def test_the_renderer_refuses_what_it_does_not_understand(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\nnamePrefix: x-\n")
    with pytest.raises(render_module.KustomizeError, match="namePrefix"):
        render_module.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(render_module.KustomizeError, match="missing.yaml not found"):
        render_module.render(tmp_path)
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {k: v}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [a.yaml]\npatches:\n  - target: {kind: ConfigMap}\n"
        "    patch: '[{op: test, path: /data/k, value: w}]'\n"
    )
    with pytest.raises(render_module.KustomizeError, match="patch of ConfigMap a"):
        render_module.render(tmp_path)


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions with In / NotIn) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        inside = labels.get(e["key"]) in e["values"]
        if (e["operator"] == "In") != inside:
            return False
    return True


def test_only_the_meshs_pods_reach_the_workers(rendered):
    """The side channel (UCX over TCP between worker pods) serves reads at any address a peer names: every worker
    pod is covered by a policy admitting the mesh's own pods, and others only to the metrics port; the router takes
    clients on its client ports and workers only on its control port."""
    for overlay, resources in rendered.items():
        policies = by_kind(resources, "NetworkPolicy")
        for owner, template in pod_templates(resources):
            labels, (c,) = template["metadata"]["labels"], template["spec"]["containers"]
            covering = [p for p in policies.values() if selects(p["spec"]["podSelector"], labels)]
            assert len(covering) == 1, f"{overlay}: {owner} is covered by {len(covering)} policies"
            rules = covering[0]["spec"]["ingress"]
            named = {port["name"] for port in c["ports"]}
            for rule in rules:
                ports = {port["port"] for port in rule.get("ports", [])}
                assert ports <= named, f"{overlay}: {owner}: the policy names ports {ports - named} it lacks"
                open_to_all = "from" not in rule
                if c["args"][0] == "router":
                    assert ports <= ({"grpc", "http"} if open_to_all else {"control"}), f"{overlay}: {owner}: {rule}"
                else:
                    assert ports == {"metrics"} if open_to_all else not ports, f"{overlay}: {owner}: {rule}"
                for peer in rule.get("from", []):
                    assert set(peer) == {"podSelector"} and peer["podSelector"] == {
                        "matchLabels": {"app.kubernetes.io/name": "deltamesh"}
                    }, f"{overlay}: {owner}: admits {peer}"
