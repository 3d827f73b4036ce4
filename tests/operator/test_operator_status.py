"""compute_status: conditions, phase and printer-column fields from children's state."""

from pdpool.operator.status import (
    RoleState,
    carried_spec_error,
    compute_status,
    merge_conditions,
    status_changed,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def state(desired, ready, rolled_out=True):
    return RoleState(desired=desired, ready=ready, updated=ready, rolled_out=rolled_out)


def status(roles, spec_error=None, old=None, now=T0):
    return compute_status(
        pool="demo",
        namespace="llm",
        generation=3,
        gateway_port=8080,
        roles=roles,
        spec_error=spec_error,
        old_conditions=old,
        now=now,
    )


def conditions(s):
    return {c["type"]: c for c in s["conditions"]}


def test_nothing_created_is_pending():
    s = status({"prefill": None, "decode": None, "gateway": None})
    assert s["phase"] == "Pending"
    c = conditions(s)
    assert c["PrefillReady"]["reason"] == "NotCreated"
    assert c["Ready"]["status"] == "False"


def test_partially_ready_is_progressing_with_counts():
    s = status({"prefill": state(2, 1), "decode": state(1, 1), "gateway": state(1, 0)})
    c = conditions(s)
    assert s["phase"] == "Progressing"
    assert c["PrefillReady"]["status"] == "False"
    assert c["PrefillReady"]["message"].endswith("1/2 replicas ready")
    assert c["DecodeReady"]["status"] == "True"
    assert c["Ready"]["message"] == "waiting for prefill, gateway"
    assert s["prefillReady"] == "1/2" and s["decodeReady"] == "1/1"
    assert s["prefill"] == {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 1}
    assert s["gateway"]["endpoint"] == "http://demo-gateway.llm.svc:8080"


def test_all_ready_is_ready_and_zero_replicas_count_as_ready():
    s = status({"prefill": state(0, 0), "decode": state(2, 2), "gateway": state(1, 1)})
    assert s["phase"] == "Ready"
    c = conditions(s)
    assert c["Ready"]["status"] == "True" and c["PrefillReady"]["reason"] == "ScaledToZero"
    assert all(x["observedGeneration"] == 3 for x in s["conditions"])


def test_unobserved_rollout_is_not_ready_even_with_old_ready_pods():
    s = status(
        {"prefill": state(1, 1, rolled_out=False), "decode": state(1, 1), "gateway": state(1, 1)}
    )
    assert conditions(s)["PrefillReady"]["reason"] == "RolloutPending"
    assert s["phase"] == "Progressing"


def test_spec_error_wins_over_ready_children():
    s = status(
        {"prefill": state(1, 1), "decode": state(1, 1), "gateway": state(1, 1)},
        spec_error=("InvalidSpec", "spec.model is required"),
    )
    c = conditions(s)
    assert s["phase"] == "Failed"
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert c["Ready"]["message"] == "spec.model is required"
    assert carried_spec_error(s, 3) == ("InvalidSpec", "spec.model is required")
    assert carried_spec_error(s, 4) is None  # the spec changed since


def test_transition_time_moves_only_on_flips():
    first = status({"prefill": state(1, 0), "decode": state(1, 1), "gateway": state(1, 1)})
    second = status(
        {"prefill": state(1, 1), "decode": state(1, 1), "gateway": state(1, 1)},
        old=first["conditions"],
        now=T1,
    )
    c = conditions(second)
    assert c["DecodeReady"]["lastTransitionTime"] == T0
    assert c["PrefillReady"]["lastTransitionTime"] == T1
    assert c["Ready"]["lastTransitionTime"] == T1


def test_unchanged_state_needs_no_patch():
    roles = {"prefill": state(1, 1), "decode": state(1, 1), "gateway": state(1, 1)}
    first = status(roles)
    again = status(roles, old=first["conditions"], now=T1)
    assert not status_changed(first, again)
    assert status_changed(
        first, status({**roles, "decode": state(2, 1)}, old=first["conditions"], now=T1)
    )


def test_merge_keeps_unknown_types_out():
    merged = merge_conditions(
        [{"type": "Other", "status": "True"}], [{"type": "Ready", "status": "True"}], T0
    )
    assert [c["type"] for c in merged] == ["Ready"]


def test_role_state_reads_a_deployment():
    dep = {
        "metadata": {"generation": 4},
        "spec": {"replicas": 3},
        "status": {"observedGeneration": 4, "readyReplicas": 2, "updatedReplicas": 3},
    }
    assert RoleState.from_deployment(dep) == RoleState(3, 2, 3, True)
    state = RoleState.from_deployment({"metadata": {"generation": 2}, "spec": {}})
    assert state.rolled_out is False
