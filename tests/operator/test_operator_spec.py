"""parse_pool_spec: defaults, and the specs the operator must refuse with a clear reason."""

import pytest

from pdpool.operator.spec import SpecError, parse_pool_spec

BASE = {"model": {"path": "/models/qwen3"}, "engine": {"image": "img:1"}}


def with_(**sections):
    spec = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        spec[key] = value
    return spec


def test_defaults_are_filled_in():
    pool = parse_pool_spec("demo", BASE)
    assert pool.engine.kind == "pdpool"
    assert pool.engine.block_size == 16 and pool.engine.kv_port == 5600
    assert pool.engine.peer_allowlist == ()  # the builders fill in the pool's own pods
    assert (pool.prefill.replicas, pool.decode.replicas, pool.gateway.replicas) == (1, 1, 1)
    assert pool.router.mode == "decode-first" and pool.router.cache_hit_threshold == 0.5
    assert pool.model.served_name == "qwen3"


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"engine": {"image": "x"}}, "spec.model is required"),
        ({"model": {"path": "/m"}}, "spec.engine is required"),
        (
            with_(model={"path": "/m", "huggingFaceId": "a/b"}),
            "exactly one of path or huggingFaceId",
        ),
        (with_(model={}), "exactly one of path or huggingFaceId"),
        (with_(model={"path": "qwen3"}), "is relative"),
        (with_(router={"cacheHitThreshold": 1.5}), "cacheHitThreshold must be in [0, 1]"),
        (with_(router={"mode": "round-robin"}), "spec.router.mode must be one of"),
        (with_(decode={"replicas": -1}), "spec.decode.replicas must be >= 0"),
        (with_(prefill={"replicas": "two"}), "spec.prefill.replicas must be an integer"),
        (with_(prefill={"gpus": 2, "tensorParallelSize": 4}), "must equal gpus"),
        (with_(decode={"tensorParallelSize": 2}), "needs gpus: 2"),
        (with_(engine={"image": "x", "kind": "sglang"}), "spec.engine.kind must be one of"),
        (with_(router={"mode": "prefill-first"}, prefill={"replicas": 0}), "prefill-first needs"),
        (with_(gateway={"port": 70000}), "spec.gateway.port must be <= 65535"),
        (with_(engine={"image": "x", "env": [{"value": "1"}]}), "env entries need a name"),
        (with_(decode={"resources": {"limits": {"memory": "lots"}}}), "'lots' is not a quantity"),
        (
            with_(engine={"image": "x", "kvSecretRef": {}}),
            "spec.engine.kvSecretRef.name is required",
        ),
        (
            with_(engine={"image": "x", "kvSecretRef": {"name": "s", "key": ""}}),
            "spec.engine.kvSecretRef.key must be",
        ),
    ],
)
def test_refused_specs_say_why(spec, fragment):
    with pytest.raises(SpecError) as err:
        parse_pool_spec("demo", spec)
    assert fragment in str(err.value)


def test_long_pool_name_is_refused():
    with pytest.raises(SpecError, match="longer than 52"):
        parse_pool_spec("p" * 53, BASE)


def test_quantities_in_kubernetes_syntax_are_accepted():
    resources = {
        "limits": {"cpu": "500m", "memory": "16Gi", "nvidia.com/gpu": 1},
        "requests": {"cpu": 2, "memory": "1.5e9"},
    }
    pool = parse_pool_spec("demo", with_(prefill={"resources": resources}))
    assert pool.prefill.resources == resources


def test_apply_errors_that_no_retry_can_fix():
    from pdpool.operator.handlers import refused_by_api_server

    assert refused_by_api_server(422, "Unsupported value")
    assert refused_by_api_server(500, "unable to convert unstructured object to apps/v1")
    assert not refused_by_api_server(500, "etcdserver: request timed out")
    assert not refused_by_api_server(429, "storage is (re)initializing")


def test_relative_path_is_fine_with_a_pvc_and_gpus_match_tp():
    pool = parse_pool_spec(
        "demo",
        with_(
            model={"path": "qwen3", "pvc": "models"}, decode={"gpus": 2, "tensorParallelSize": 2}
        ),
    )
    assert pool.model.pvc == "models" and pool.decode.gpus == 2
