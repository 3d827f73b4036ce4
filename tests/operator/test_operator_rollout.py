"""Rolling updates and drains: every role's Deployment replaces pods without serving with
fewer than asked for (spec.rollout), every leaving engine pod drains (not only autoscaled
ones), and the pool's status reports a rollout's progress as `kubectl rollout status` does."""

import pytest

from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.drain import DRAIN_SCRIPT
from pdpool.operator.spec import SpecError, parse_pool_spec
from pdpool.operator.status import RoleState, compute_status, rollout_progress

REF = PoolRef(name="demo", namespace="llm", uid="uid-1")
BASE = {
    "model": {"path": "/models/qwen3"},
    "engine": {"image": "engine:1"},
    "router": {"image": "slim:1"},
}


def deployments(**extra):
    spec = {**BASE, **extra}
    return {
        m["metadata"]["name"]: m
        for m in build_children(REF, parse_pool_spec(REF.name, spec))
        if m["kind"] == "Deployment"
    }


def test_by_default_a_new_pod_is_ready_before_an_old_one_goes():
    for name, d in deployments().items():
        assert d["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }, name


def test_a_gpu_tight_pool_may_replace_in_place():
    out = deployments(rollout={"maxSurge": 0, "maxUnavailable": "50%", "drainSeconds": 60})
    for d in out.values():
        assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": "50%"}
    pod = out["demo-decode"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 60


def test_every_engine_pod_drains_without_autoscaling():
    out = deployments()
    for role in ("prefill", "decode"):
        pod = out[f"demo-{role}"]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 300
        hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:3] == ["python3", "-c", DRAIN_SCRIPT]
        # held 15 s, then at most the grace less the hold and SIGTERM's margin
        assert hook[3:5] == ["15", "280"]
        assert "vllm:num_requests_running" in hook[5]
    decode = out["demo-decode"]["spec"]["template"]["spec"]["containers"]
    assert decode[1]["lifecycle"]["preStop"]  # the sidecar drains its in-flight requests
    assert "replicas" in out["demo-decode"]["spec"]  # the spec's count (no autoscaling)


@pytest.mark.parametrize(
    "rollout, message",
    [
        ({"maxSurge": 0, "maxUnavailable": 0}, "cannot both be 0"),
        ({"maxSurge": "0%", "maxUnavailable": "0%"}, "cannot both be 0"),
        ({"maxSurge": -1}, "maxSurge must be a count >= 0"),
        ({"maxSurge": True}, "maxSurge must be a count"),
        ({"maxUnavailable": "lots"}, "maxUnavailable must be a count"),
        ({"maxUnavailable": "1000000%"}, "maxUnavailable must be a count"),
        ({"maxSurge": 10**12}, "maxSurge must be a count"),
        ({"drainSeconds": 1}, "drainSeconds must be >= 10"),
        ({"drainSeconds": 10**9}, "drainSeconds must be <= 86400"),
        ({"drainSeconds": "60"}, "drainSeconds must be an integer"),
    ],
)
def test_rollout_refusals_name_the_field(rollout, message):
    with pytest.raises(SpecError, match=message):
        parse_pool_spec("demo", {**BASE, "rollout": rollout})


def role(desired, updated, total, available, observed=True):
    return RoleState(
        desired=desired,
        ready=available,
        updated=updated,
        rolled_out=observed,
        total=total,
        available=available,
    )


@pytest.mark.parametrize(
    "state, done, words",
    [
        (None, False, "does not exist yet"),
        (role(2, 0, 2, 2, observed=False), False, "spec update to be observed"),
        (role(2, 1, 3, 2), False, "1 out of 2 new replicas have been updated"),
        (role(2, 2, 3, 2), False, "1 old replicas are pending termination"),
        (role(2, 2, 2, 1), False, "1 of 2 updated replicas are available"),
        (role(2, 2, 2, 2), True, 'deployment "demo-decode" successfully rolled out'),
    ],
)
def test_rollout_progress_speaks_as_kubectl_rollout_status(state, done, words):
    ok, message = rollout_progress("demo-decode", state)
    assert ok is done and words in message


def test_the_pool_reports_a_rollout_until_old_pods_are_gone():
    def status(roles):
        s = compute_status(
            pool="demo",
            namespace="llm",
            generation=4,
            gateway_port=8080,
            roles=roles,
            spec_error=None,
            old_conditions=None,
            now="2026-01-01T00:00:00Z",
        )
        return s, {c["type"]: c for c in s["conditions"]}

    done = role(1, 1, 1, 1)
    s, c = status({"prefill": done, "decode": role(2, 1, 3, 2), "gateway": done})
    assert c["RolledOut"]["status"] == "False"
    assert c["RolledOut"]["reason"] == "RollingUpdate"
    assert '"demo-decode"' in c["RolledOut"]["message"]
    assert s["decode"]["updatedReplicas"] == 1
    s, c = status({"prefill": done, "decode": role(2, 2, 2, 2), "gateway": done})
    assert c["RolledOut"]["status"] == "True" and c["Ready"]["status"] == "True"
