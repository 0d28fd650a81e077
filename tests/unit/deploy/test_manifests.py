"""deploy/: every manifest validates offline, overlays render, and the commands in them parse."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml

from elastic import env
from tests.unit.deploy.kustomize_lite import load_documents, render

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.37.0"
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
# Whole resources (not kustomizations, not overlay patches, not custom resources).
CORE_FILES = sorted(
    p for p in K8S.rglob("*.yaml")
    if p.name != "kustomization.yaml" and "overlays" not in p.parts
    and p.parent.name not in ("pytorchjob", "monitoring")  # custom resources: shape-checked
)
PYTORCHJOB = K8S / "pytorchjob" / "pytorchjob.yaml"


def _validate(resource: dict[str, Any]) -> None:
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def _rendered(name: str) -> list[dict[str, Any]]:
    return render(K8S / name)


def _one(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env vars in {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_deploy_tree_has_every_manifest_the_platform_team_needs() -> None:
    names = {str(p.relative_to(K8S)) for p in K8S.rglob("*.yaml")}
    assert {"etcd/statefulset.yaml", "etcd/services.yaml", "etcd/pdb.yaml",
            "etcd/networkpolicy.yaml", "train/job.yaml", "pytorchjob/pytorchjob.yaml",
            "train/overlays/s3-credentials/kustomization.yaml",
            "train/overlays/minio/kustomization.yaml", "monitoring/podmonitor.yaml",
            "monitoring/prometheusrule.yaml"} <= names
    assert (DEPLOY / "grafana" / "elastic-run-dashboard.json").is_file()


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(K8S)))
def test_core_manifest_validates_strictly_against_the_kubernetes_schema(path: Path) -> None:
    documents = load_documents(path)
    assert documents
    for document in documents:
        _validate(document)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_kustomization_renders_into_valid_namespaced_resources(directory: Path) -> None:
    resources = render(directory)
    assert resources
    for resource in resources:
        _validate(resource)
        assert resource["metadata"]["namespace"] == "elastic-run"


def test_strict_validation_rejects_a_misspelt_field() -> None:
    job = load_documents(K8S / "train" / "job.yaml")[0]
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(job)


def test_s3_overlay_takes_keys_from_a_secret_and_minio_adds_its_endpoint() -> None:
    base = _container(_one(_rendered("train"), "Job", "elastic-train")["spec"]["template"]["spec"],
                      "trainer")
    s3 = _container(
        _one(_rendered("train/overlays/s3-credentials"), "Job", "elastic-train")
        ["spec"]["template"]["spec"], "trainer")
    minio = _container(
        _one(_rendered("train/overlays/minio"), "Job", "elastic-train")
        ["spec"]["template"]["spec"], "trainer")
    assert "envFrom" not in base
    for container in (s3, minio):
        assert container["envFrom"] == [{"secretRef": {"name": "checkpoint-s3"}}]
    assert "AWS_ENDPOINT_URL" not in _env(s3)
    minio_env = _env(minio)
    assert minio_env["AWS_ENDPOINT_URL"] == minio_env["FSSPEC_S3_ENDPOINT_URL"]
    assert minio_env["CHECKPOINT_URL"] == "s3://elastic-train/checkpoints"
    assert minio_env["EVENTS_URL"] == "s3://elastic-train/events"
    # The overlay keeps everything else of the base container.
    assert minio["args"] == base["args"]
    assert _env(base)["ELASTIC_ETCD_PASSWORD"] == minio_env["ELASTIC_ETCD_PASSWORD"]


def _pytorchjob_model() -> Any:
    from kubeflow.training.api_client import ApiClient

    class _Response:
        data = PYTORCHJOB.read_text()

    document = load_documents(PYTORCHJOB)[0]
    _Response.data = json.dumps(document)
    client = ApiClient()
    return client, client.deserialize(_Response(), "KubeflowOrgV1PyTorchJob"), document


def test_pytorchjob_loads_into_the_kubeflow_sdk_model_without_unknown_fields() -> None:
    client, job, document = _pytorchjob_model()
    assert job.spec.elastic_policy.rdzv_backend == "elastic-etcd-v3"
    assert (job.spec.elastic_policy.min_replicas, job.spec.elastic_policy.max_replicas) == (2, 4)
    # The SDK drops fields it does not know: a round trip that changes nothing proves none were.
    assert client.sanitize_for_serialization(job) == document
    worker = document["spec"]["pytorchReplicaSpecs"]["Worker"]
    _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
               "template": worker["template"]})


def _command_lines() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    job = load_documents(K8S / "train" / "job.yaml")[0]
    pytorchjob = load_documents(PYTORCHJOB)[0]
    pj_pod = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return [
        ("job", job, _container(job["spec"]["template"]["spec"], "trainer")),
        ("pytorchjob", pytorchjob, _container(pj_pod, "pytorch")),
    ]


def _expand(arg: str, values: dict[str, str]) -> str:
    # Kubernetes expands $(NAME) in command/args from the container's env.
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values[m.group(1)], arg)


@pytest.mark.parametrize("name", ["job", "pytorchjob"])
def test_manifest_command_line_parses_with_elastic_runs_own_parser(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launch import cli

    for key in list(os.environ):
        if key.startswith(("PET_", "ELASTIC_")):
            monkeypatch.delenv(key)
    resource, container = next((r, c) for n, r, c in _command_lines() if n == name)
    assert container["command"] == ["elastic-run"]
    values = {k: (v if isinstance(v, str) else f"{k.lower()}-from-downward-api")
              for k, v in _env(container).items()}
    argv = [_expand(a, values) for a in container["args"]]
    script = next(a for a in argv if a.endswith(".py"))
    local_script = tmp_path / "train.py"
    local_script.write_text("")
    argv[argv.index(script)] = str(local_script)
    args = cli.parse_args(argv)
    assert (args.min_nodes, args.max_nodes) == (2, 4)
    assert int(args.nproc_per_node) == 8
    assert args.rdzv_backend == "elastic-etcd-v3"
    assert args.rdzv_endpoint == "etcd-client:2379"
    assert "protocol=https" in args.rdzv_conf  # the scheme of --etcd is not relied upon
    assert args.rdzv_id.endswith("-from-downward-api")
    assert args.training_script == str(local_script)
    assert args.training_script_args == ["--checkpoint-url=s3://CHANGE-ME-bucket/elastic-train"]
    # Live metrics on the port Prometheus is told about; the event log under the job's prefix.
    annotations = (resource["spec"]["template"] if name == "job" else resource["spec"]
                   ["pytorchReplicaSpecs"]["Worker"]["template"])["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.metrics_port == ports["metrics"] == int(annotations["prometheus.io/port"])
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert args.events_dir == "s3://CHANGE-ME-bucket/elastic-train/events"
    if name == "job":
        spec = resource["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["parallelism"] == spec["completions"] == args.max_nodes
        assert spec["successPolicy"]["rules"] == [{"succeededCount": args.min_nodes}]
    else:
        policy = resource["spec"]["elasticPolicy"]
        assert (policy["minReplicas"], policy["maxReplicas"]) == (args.min_nodes,
                                                                  args.max_nodes)
        assert policy["nProcPerNode"] == int(args.nproc_per_node)
        assert resource["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == args.max_nodes


@pytest.mark.parametrize("name", ["job", "pytorchjob"])
def test_training_pods_are_sized_for_spot_and_read_etcd_credentials_from_secrets(
    name: str,
) -> None:
    resource, container = next((r, c) for n, r, c in _command_lines() if n == name)
    pod = (resource["spec"]["template"]["spec"] if name == "job"
           else resource["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"])
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert any("spot" in t["key"] for t in pod["tolerations"])
    variables = _env(container)
    for key in ("ELASTIC_ETCD_USERNAME", "ELASTIC_ETCD_PASSWORD"):
        assert variables[key]["secretKeyRef"]["name"] == "etcd-client-credentials"
    known = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)}
    assert {k for k in variables if k.startswith("ELASTIC_")} <= known
    # The runtime sets NCCL's error handling per mode (in place needs 0): never the manifest.
    assert not [k for k in variables if "ASYNC_ERROR_HANDLING" in k], sorted(variables)
    # Credentials never sit in the manifest itself.
    text = yaml.safe_dump(resource)
    assert "password:" not in text.lower().replace("key: password", "")


def test_network_policy_admits_exactly_the_pods_that_talk_to_etcd() -> None:
    etcd = _rendered("etcd")
    policy = _one(etcd, "NetworkPolicy", "etcd")
    statefulset = _one(etcd, "StatefulSet", "etcd")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= \
        statefulset["spec"]["template"]["metadata"]["labels"].items()
    client_rule = next(r for r in policy["spec"]["ingress"]
                       if [p["port"] for p in r["ports"]] == [2379])
    allowed = client_rule["from"][0]["podSelector"]["matchLabels"]
    templates = [
        _one(etcd, "Job", "etcd-enable-auth")["spec"]["template"],
        load_documents(K8S / "train" / "job.yaml")[0]["spec"]["template"],
        load_documents(PYTORCHJOB)[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"],
    ]
    for template in templates:
        assert allowed.items() <= template["metadata"]["labels"].items()
    assert _one(etcd, "PodDisruptionBudget", "etcd")["spec"]["maxUnavailable"] == 1
    assert statefulset["spec"]["replicas"] == 3


def test_etcd_requires_client_certificates_on_both_ports() -> None:
    container = _container(_one(_rendered("etcd"), "StatefulSet", "etcd")["spec"]["template"]
                           ["spec"], "etcd")
    args = container["args"]
    assert "--client-cert-auth=true" in args and "--peer-client-cert-auth=true" in args
    assert all(a.split("=", 1)[1].startswith("https://") for a in args
               if a.startswith(("--listen-client-urls", "--listen-peer-urls")))


def _secret_names(node: Any) -> set[str]:
    names: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "secretName":
                names.add(value)
            elif key in ("secretRef", "secretKeyRef"):
                names.add(value["name"])
            else:
                names |= _secret_names(value)
    elif isinstance(node, list):
        for item in node:
            names |= _secret_names(item)
    return names


def test_every_secret_the_manifests_use_is_documented_in_the_readme() -> None:
    readme = (DEPLOY / "README.md").read_text()
    secrets: set[str] = set()
    for path in K8S.rglob("*.yaml"):
        for document in load_documents(path):
            secrets |= _secret_names(document)
    assert {"etcd-server-tls", "etcd-peer-tls", "etcd-client-tls", "etcd-client-credentials",
            "etcd-root-credentials", "checkpoint-s3"} == secrets
    for secret in secrets:
        assert re.search(rf"kubectl .*create secret \S+ {secret}\b", readme), secret


def _installed_packages() -> list[str]:
    """Top-level packages of pyproject's ``[tool.setuptools.packages.find] include``."""
    with open(ROOT / "pyproject.toml", "rb") as fileobj:
        include = tomllib.load(fileobj)["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({re.split(r"[.*]", pattern, maxsplit=1)[0] for pattern in include})


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_parses_and_copies_only_what_the_repository_has(name: str) -> None:
    import dockerfile_parse

    with open(DEPLOY / "docker" / name, "rb") as fileobj:
        instructions = dockerfile_parse.DockerfileParser(fileobj=fileobj).structure
    assert instructions, "empty Dockerfile"
    copies = [i["value"] for i in instructions if i["instruction"] == "COPY"]
    for value in copies:
        parts = shlex.split(value)
        if any(p.startswith("--from=") for p in parts):
            continue
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"{name} copies {source}, which the repo lacks"
    # The wheel is built from what was copied: every installed package must be there.
    copied = {shlex.split(v)[0].rstrip("/") for v in copies if not v.startswith("--from=")}
    assert set(_installed_packages()) <= copied, (
        f"{name} copies {sorted(copied)} but the wheel installs {_installed_packages()}")
    runs = " ".join(i["value"] for i in instructions if i["instruction"] == "RUN")
    assert "torch==2.13.0" in runs
    entrypoint = next(i["value"] for i in instructions if i["instruction"] == "ENTRYPOINT")
    assert json.loads(entrypoint)[-1] == "elastic-run"
    assert 'elastic-run = "launch.cli:main"' in (ROOT / "pyproject.toml").read_text()
