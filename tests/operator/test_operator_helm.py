"""The Helm chart: lint, render-and-validate against the real API server, install, RBAC.

The RBAC test runs the operator with the token of the ServiceAccount the chart created:
the full reconcile must work with exactly those permissions, and nothing beyond them is
granted.
"""

import json
import subprocess
import uuid

import pytest
import yaml
from kubernetes import client

from pdpool.operator.kube import request

from devtools.operator_kube import (
    CHART,
    CRD_FILE,
    OperatorProcess,
    Pools,
    children_exist,
    pool_manifest,
    wait_for,
)

# The first test to use the cluster may have to build it (cold: ~20 min on 2 cores).
pytestmark = pytest.mark.timeout(3000)

RELEASE, SYSTEM_NS = "pdpool", "pdpool-system"
EXPECTED_RULES = {
    ("pdpool.io", "pdinferencepools"): {"get", "list", "watch", "patch"},
    ("pdpool.io", "pdinferencepools/status"): {"patch"},
    ("apps", "deployments"): {"list", "watch", "create", "patch"},
    ("", "services"): {"create", "patch"},
    ("", "configmaps"): {"create", "patch"},
    ("policy", "poddisruptionbudgets"): {"create", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"create", "patch"},
    ("", "secrets"): {"create"},
    ("", "events"): {"create"},
    ("", "pods"): {"list"},  # the autoscaling planner reads their metrics
    # mode hpa / keda; another mode's are read and deleted when the mode changes
    ("autoscaling", "horizontalpodautoscalers"): {"get", "create", "patch", "delete"},
    ("keda.sh", "scaledobjects"): {"get", "create", "patch", "delete"},
    # spec.inferencePool: the EPP's account, the InferencePool (its status read back), a route
    ("", "serviceaccounts"): {"create", "patch"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch", "create", "patch"},
    ("gateway.networking.k8s.io", "httproutes"): {"create", "patch"},
    # spec.loras rollouts (deleted once no adapter has one)
    ("inference.networking.x-k8s.io", "inferencemodelrewrites"): {
        "get",
        "create",
        "patch",
        "delete",
    },
}


def helm(helm_bin, *args, check=True, k8s=None):
    cmd = [str(helm_bin), *args]
    if k8s is not None:
        cmd += ["--kubeconfig", str(k8s.kubeconfig)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(helm_bin, *sets):
    args = ["template", RELEASE, str(CHART), "--namespace", SYSTEM_NS]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(helm_bin, *args).stdout) if d]


def rules_of(role):
    granted = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_chart_crd_is_the_repository_crd():
    assert (CHART / "crds" / CRD_FILE.name).read_text() == CRD_FILE.read_text()


@pytest.mark.parametrize(
    "sets",
    [
        [],
        [
            "serviceMonitor.enabled=true",
            "examplePool.enabled=true",
            "watchNamespaces={team-a,team-b}",
        ],
        ["podMonitor.enabled=true", "watchAllNamespaces=true", "aggregatedRoles=false"],
    ],
)
def test_helm_lint_is_clean(helm_bin, sets):
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(helm_bin, *args)
    assert "0 chart(s) failed" in out.stdout


def test_values_schema_rejects_bad_values(helm_bin):
    bad = helm(
        helm_bin,
        "template",
        "x",
        str(CHART),
        "--set",
        "examplePool.cacheHitThreshold=2",
        check=False,
    )
    assert bad.returncode != 0 and "cacheHitThreshold" in bad.stderr
    typo = helm(helm_bin, "template", "x", str(CHART), "--set", "imagee.tag=1", check=False)
    assert typo.returncode != 0 and "imagee" in typo.stderr


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["examplePool.enabled=true", "verbose=true"],
        ["watchNamespaces={team-a,team-b}"],
        ["watchAllNamespaces=true"],
    ],
)
def test_rendered_manifests_pass_server_side_validation(helm_bin, admin_api, sets):
    """Each rendered object is dry-run created with strict field validation."""
    core = client.CoreV1Api(admin_api)
    for ns in (SYSTEM_NS, "team-a", "team-b"):
        try:
            core.create_namespace({"metadata": {"name": ns}})
        except client.ApiException as exc:
            assert exc.status == 409
    docs = render(helm_bin, *sets)
    assert docs, "nothing rendered"
    for doc in docs:
        group_version = doc["apiVersion"]
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        plural = {
            "ServiceAccount": "serviceaccounts",
            "ClusterRole": "clusterroles",
            "ClusterRoleBinding": "clusterrolebindings",
            "Role": "roles",
            "RoleBinding": "rolebindings",
            "Deployment": "deployments",
            "PDInferencePool": "pdinferencepools",
            "ConfigMap": "configmaps",
        }[doc["kind"]]
        ns = doc["metadata"].get("namespace")
        path = f"{prefix}/namespaces/{ns}/{plural}" if ns else f"{prefix}/{plural}"
        request(
            admin_api,
            "POST",
            path,
            doc,
            "application/json",
            [("dryRun", "All"), ("fieldValidation", "Strict")],
        )
    kinds = {d["kind"] for d in docs}
    # The operator's own ClusterRole only when it watches every namespace; the aggregated
    # pdpool-view / pdpool-edit grant nothing to anyone by themselves.
    operator_cluster_roles = [
        d
        for d in docs
        if d["kind"] in ("ClusterRole", "ClusterRoleBinding")
        and d["metadata"]["name"] not in ("pdpool-view", "pdpool-edit")
    ]
    if "watchAllNamespaces=true" in sets:
        assert operator_cluster_roles and "Role" not in kinds
    else:
        assert not operator_cluster_roles and "Role" in kinds
        roles = {d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"}
        assert roles == (
            {"team-a", "team-b"}
            if any(s.startswith("watchNamespaces") for s in sets)
            else {SYSTEM_NS}
        )


def test_grafana_dashboard_configmap_carries_the_repository_dashboard(helm_bin):
    """The Grafana sidecar loads ConfigMaps labelled grafana_dashboard=1: the chart's holds
    dashboards/pdpool.json as it is in the repository."""
    (cm,) = [d for d in render(helm_bin) if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["pdpool.json"])
    assert shipped == json.loads((CHART / "dashboards" / "pdpool.json").read_text())
    assert shipped["panels"] and all(p["targets"] for p in shipped["panels"])
    off = render(helm_bin, "grafanaDashboard.enabled=false")
    assert "ConfigMap" not in {d["kind"] for d in off}


def test_default_install_is_namespaced(helm_bin):
    docs = render(helm_bin)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--namespace={SYSTEM_NS}" in command and "--all-namespaces" not in command
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["metadata"]["namespace"] == SYSTEM_NS


def test_pod_monitor_scrapes_engines_sidecars_and_gateways(helm_bin):
    for flag in ("podMonitor.enabled=true", "serviceMonitor.enabled=true"):  # old name too
        docs = render(helm_bin, flag)
        (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
        assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "pdpool"
        endpoints = {e["port"]: e["path"] for e in monitor["spec"]["podMetricsEndpoints"]}
        assert endpoints == {  # the metrics ports only: never 8000 / 8080
            "metrics": "/metrics",
            "sc-metrics": "/metrics",
            "metrics-tls": "/metrics",
            "sc-metrics-tls": "/metrics",
        }
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [SYSTEM_NS]}
    # The ports it names are the containers' port names in every role's pods.
    from pdpool.operator.builders import build_children
    from pdpool.operator.children import PoolRef
    from pdpool.operator.spec import parse_pool_spec

    kids = build_children(
        PoolRef("demo", "llm", "u"), parse_pool_spec("demo", pool_manifest("demo")["spec"])
    )
    scraped = set()
    for d in kids:
        if d["kind"] != "Deployment":
            continue
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert labels.items() >= monitor["spec"]["selector"]["matchLabels"].items()
        for c in d["spec"]["template"]["spec"]["containers"]:
            for p in c["ports"]:
                if p["name"] in endpoints:
                    scraped.add((labels["pdpool.io/role"], c["name"], p["containerPort"]))
    assert scraped == {
        ("prefill", "engine", 9090),
        ("decode", "engine", 9090),
        ("decode", "sidecar", 9091),
        ("gateway", "gateway", 9090),
    }
    everywhere = render(helm_bin, "podMonitor.enabled=true", "watchAllNamespaces=true")
    (monitor,) = [d for d in everywhere if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_aggregated_roles_let_namespace_editors_create_pools(helm_bin, k8s, admin_api):
    """pdpool-edit aggregates into the built-in edit role, pdpool-view into view (the
    clusterrole-aggregation controller runs in the test cluster)."""
    docs = render(helm_bin)
    for d in docs:
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] in ("pdpool-view", "pdpool-edit"):
            try:
                request(
                    admin_api,
                    "POST",
                    "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                    d,
                    "application/json",
                )
            except client.ApiException as exc:
                assert exc.status == 409
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    core, rbac = client.CoreV1Api(admin_api), client.RbacAuthorizationV1Api(admin_api)
    core.create_namespace({"metadata": {"name": namespace}})
    for user, role in (("alice", "edit"), ("bob", "view")):
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": user},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role,
                },
                "subjects": [
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
                ],
            },
        )
    review = client.AuthorizationV1Api(admin_api)

    def allowed(user, verb):
        return review.create_subject_access_review(
            {
                "spec": {
                    "user": user,
                    "resourceAttributes": {
                        "verb": verb,
                        "group": "pdpool.io",
                        "resource": "pdinferencepools",
                        "namespace": namespace,
                    },
                }
            }
        ).status.allowed

    wait_for(lambda: allowed("alice", "create"), 30, what="edit aggregates pdpool-edit")
    assert allowed("alice", "delete") and allowed("bob", "list") and allowed("bob", "watch")
    assert not allowed("bob", "create") and not allowed("bob", "delete")
    assert not allowed("carol", "list")


def test_helm_install_then_operator_runs_with_exactly_the_chart_rbac(
    helm_bin, k8s, admin_api, tmp_path
):
    helm(
        helm_bin,
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "--namespace",
        SYSTEM_NS,
        "--create-namespace",
        "--set",
        "watchAllNamespaces=true",
        "--set",
        "aggregatedRoles=false",
        k8s=k8s,
    )
    apps, rbac = client.AppsV1Api(admin_api), client.RbacAuthorizationV1Api(admin_api)
    deployment = apps.read_namespaced_deployment(f"{RELEASE}-pdpool-operator", SYSTEM_NS)
    command = deployment.spec.template.spec.containers[0].command
    assert command[:3] == ["pdpool", "operator", "--all-namespaces"]
    role = rbac.read_cluster_role(f"{RELEASE}-pdpool-operator").to_dict()
    granted = rules_of(
        {
            "rules": [
                {"apiGroups": r["api_groups"], "resources": r["resources"], "verbs": r["verbs"]}
                for r in role["rules"]
            ]
        }
    )
    assert granted == EXPECTED_RULES

    # The operator, authenticated as the chart's ServiceAccount.
    token = (
        client.CoreV1Api(admin_api)
        .create_namespaced_service_account_token(
            f"{RELEASE}-pdpool-operator",
            SYSTEM_NS,
            {"spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}},
        )
        .status.token
    )
    kubeconfig = k8s.write_kubeconfig(tmp_path / "sa.kubeconfig", token, "pdpool-operator")
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(admin_api).create_namespace({"metadata": {"name": namespace}})
    pools = Pools(admin_api, namespace)
    op = OperatorProcess(kubeconfig, tmp_path / "sa-operator.log").start()
    try:
        pools.create(pool_manifest("rbac", decode={"tensorParallelSize": 2}))  # -> an Event
        pools.create(pool_manifest("rbac-ok"))
        wait_for(lambda: children_exist(pools, "rbac-ok"), 40, what="children as the SA")
        assert "rbac-ok-kv-secret" in pools.secrets("rbac-ok")  # created with `create` alone
        for role_name in ("prefill", "decode", "gateway"):
            pools.mark_ready("rbac-ok", role_name)
        wait_for(
            lambda: pools.get("rbac-ok").get("status", {}).get("phase") == "Ready",
            30,
            what="Ready as the SA",
        )
        wait_for(
            lambda: any(e.reason == "InvalidSpec" for e in pools.events("rbac")),
            20,
            what="event posted as the SA",
        )
        pools.patch_spec("rbac-ok", {"decode": {"replicas": 2}})
        wait_for(
            lambda: pools.deployments("rbac-ok")["decode"].spec.replicas == 2,
            30,
            what="update as the SA",
        )
        log = op.log()
        assert "403" not in log and "Forbidden" not in log, log[-3000:]
    finally:
        op.stop()

    # ... and nothing more than that.
    sa_api = client.ApiClient(_config_from(k8s, token))
    review = client.AuthorizationV1Api(sa_api)

    def allowed(verb, resource, group="", ns=namespace, subresource=None):
        attrs = {"verb": verb, "resource": resource, "group": group, "namespace": ns}
        if subresource:
            attrs["subresource"] = subresource
        return review.create_self_subject_access_review(
            {"spec": {"resourceAttributes": attrs}}
        ).status.allowed

    assert allowed("patch", "deployments", "apps")
    assert allowed("watch", "pdinferencepools", "pdpool.io")
    assert allowed("create", "secrets")
    for verb, resource, group in [
        ("delete", "deployments", "apps"),
        ("get", "secrets", ""),
        ("list", "secrets", ""),
        ("patch", "secrets", ""),
        ("update", "secrets", ""),
        ("delete", "secrets", ""),
        ("create", "pods", ""),
        ("delete", "pdinferencepools", "pdpool.io"),
        ("update", "pdinferencepools", "pdpool.io"),
        ("create", "pdinferencepools", "pdpool.io"),
        ("delete", "services", ""),
        ("list", "services", ""),
        ("create", "clusterroles", "rbac.authorization.k8s.io"),
        ("list", "customresourcedefinitions", "apiextensions.k8s.io"),
    ]:
        assert not allowed(verb, resource, group), f"{verb} {group}/{resource} must be denied"
    sa_api.close()


def _config_from(k8s, token):
    config = client.Configuration()
    config.host = k8s.server
    config.ssl_ca_cert = str(k8s.ca_file)
    config.api_key = {"authorization": token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return config


def test_namespaced_install_needs_no_cluster_role(helm_bin, k8s, admin_api, tmp_path):
    """watchNamespaces: Roles in the watched namespaces only, and the operator still works."""
    watched = f"t-{uuid.uuid4().hex[:8]}"
    release, system_ns = "pdns", "pdns-system"
    core = client.CoreV1Api(admin_api)
    core.create_namespace({"metadata": {"name": watched}})
    helm(
        helm_bin,
        "upgrade",
        "--install",
        release,
        str(CHART),
        "--namespace",
        system_ns,
        "--create-namespace",
        "--set",
        f"watchNamespaces={{{watched}}}",
        "--set",
        "aggregatedRoles=false",
        k8s=k8s,
    )
    rbac = client.RbacAuthorizationV1Api(admin_api)
    names = [r.metadata.name for r in rbac.list_cluster_role().items]
    assert f"{release}-pdpool-operator" not in names
    role = rbac.read_namespaced_role(f"{release}-pdpool-operator", watched)
    assert {(r.api_groups[0], r.resources[0]) for r in role.rules} <= set(EXPECTED_RULES)
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment(
        f"{release}-pdpool-operator", system_ns
    )
    assert f"--namespace={watched}" in deployment.spec.template.spec.containers[0].command

    token = core.create_namespaced_service_account_token(
        f"{release}-pdpool-operator",
        system_ns,
        {"spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}},
    ).status.token
    kubeconfig = k8s.write_kubeconfig(tmp_path / "ns.kubeconfig", token, "pdns")
    pools = Pools(admin_api, watched)
    op = OperatorProcess(kubeconfig, tmp_path / "ns-operator.log", "--namespace", watched).start()
    try:
        pools.create(pool_manifest("scoped"))
        wait_for(lambda: children_exist(pools, "scoped"), 40, what="children, namespaced")
        for role_name in ("prefill", "decode", "gateway"):
            pools.mark_ready("scoped", role_name)
        wait_for(
            lambda: pools.get("scoped").get("status", {}).get("phase") == "Ready",
            30,
            what="Ready, namespaced",
        )
        log = op.log()
        assert "403" not in log and "Forbidden" not in log, log[-3000:]
    finally:
        op.stop()
