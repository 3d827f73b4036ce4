"""`spec.loras`: the spec's checks, the LoRA flags every engine gets (parsed by the real
`pdpool serve` CLI into a valid engine config), the claims mounted read-only, hub adapters
fetched by init containers the way the base model is, runtime updates (engines and the
sidecar), and on the real API server: the CRD takes the section, a bad one gives the pool a
failed condition naming the field, a good one's Deployments are accepted."""

import re

import pytest

from devtools.operator_kube import children_exist, pool_manifest, wait_for
from pdpool.operator.commands import hf_download_args
from pdpool.operator.loras import HUB_MOUNT, LORA_MOUNT
from pdpool.operator.spec import SpecError, parse_pool_spec
from tests.support.operator_pods import (
    BASE,
    REF,
    container,
    engine_config,
    engine_pods,
    sidecar_args,
)

HUB = {
    "adapters": [
        {"name": "sql", "hub": "acme/qwen3-sql-lora", "revision": "v2"},
        {"name": "chat.v1", "hub": "acme/chat_lora"},
        {"name": "legal", "path": "/models/adapters/legal"},
    ]
}


def test_both_roles_serve_the_same_adapters():
    spec = {
        **BASE,
        "loras": {
            "maxLoras": 2,
            "maxRank": 32,
            "adapters": [
                {"name": "support", "pvc": "adapters", "subPath": "support"},
                {"name": "legal", "path": "/models/adapters/legal"},
            ],
        },
    }
    pods = engine_pods(spec)
    assert len(pods) == 2  # prefill and decode
    for pod in pods.values():
        config, engine = engine_config(pod)
        assert config.enable_lora and (config.max_loras, config.max_lora_rank) == (2, 32)
        assert config.lora_modules == [
            f"support={LORA_MOUNT}/support",
            "legal=/models/adapters/legal",
        ]
        assert config.lora_allowed_dirs == []  # no runtime updates unless asked
        mount = next(m for m in engine["volumeMounts"] if m["name"] == "lora-support")
        assert mount == {
            "name": "lora-support",
            "mountPath": f"{LORA_MOUNT}/support",
            "readOnly": True,
            "subPath": "support",
        }
        volume = next(v for v in pod["volumes"] if v["name"] == "lora-support")
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
        assert not [v for v in pod["volumes"] if v["name"] == "lora-legal"]
        assert "initContainers" not in pod  # nothing to fetch


def test_hub_adapters_are_fetched_like_the_base_model_into_a_shared_folder():
    spec = {
        **BASE,
        "model": {"huggingFaceId": "Qwen/Qwen3-0.6B", "hfTokenSecret": "hf"},
        "loras": HUB,
    }
    pool = parse_pool_spec(REF.name, spec)
    pods = engine_pods(spec)
    assert len(pods) == 2
    for pod in pods.values():
        model_fetch, *fetches = pod["initContainers"]
        assert model_fetch["name"] == "fetch-model"
        assert model_fetch["command"] == hf_download_args(pool.model)
        assert [f["name"] for f in fetches] == ["fetch-lora-0", "fetch-lora-1"]
        for fetch, (repo, name, revision) in zip(
            fetches,
            [("acme/qwen3-sql-lora", "sql", "v2"), ("acme/chat_lora", "chat.v1", "")],
            strict=True,
        ):
            # The same mechanism as the model's: the same script, image, token, limits.
            assert fetch["command"][:3] == model_fetch["command"][:3]
            assert fetch["command"][3:] == [repo, f"{HUB_MOUNT}/{name}", revision]
            for key in ("image", "env", "resources", "securityContext"):
                assert fetch[key] == model_fetch[key], key
            assert {"name": "lora-hub", "mountPath": HUB_MOUNT} in fetch["volumeMounts"]
        config, engine = engine_config(pod)
        assert config.lora_modules == [
            f"sql={HUB_MOUNT}/sql",
            f"chat.v1={HUB_MOUNT}/chat.v1",
            "legal=/models/adapters/legal",
        ]
        # The engine reads what the init steps wrote, read-only; one emptyDir per pod.
        assert {"name": "lora-hub", "mountPath": HUB_MOUNT, "readOnly": True} in engine[
            "volumeMounts"
        ]
        assert {"name": "lora-hub", "emptyDir": {}} in pod["volumes"]


def test_hub_adapters_without_a_hub_model_need_no_model_fetch():
    for pod in engine_pods({**BASE, "loras": HUB}).values():
        assert [c["name"] for c in pod["initContainers"]] == ["fetch-lora-0", "fetch-lora-1"]
        assert "HF_TOKEN" not in {e["name"] for e in pod["initContainers"][0]["env"]}


def test_runtime_updates_reach_the_engines_and_the_sidecar():
    spec = {
        **BASE,
        "loras": {
            "runtimeUpdates": True,
            "adapters": [{"name": "a", "pvc": "adapters"}, {"name": "b", "hub": "acme/b"}],
        },
    }
    pods = engine_pods(spec)
    for pod in pods.values():
        config, engine = engine_config(pod)
        assert config.lora_allowed_dirs == [LORA_MOUNT, HUB_MOUNT]
        assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"} in engine["env"]
    assert sidecar_args(spec).lora_allowed_dirs == [LORA_MOUNT, HUB_MOUNT]
    explicit = {**spec, "loras": {**spec["loras"], "allowedDirs": ["/models/adapters"]}}
    assert sidecar_args(explicit).lora_allowed_dirs == ["/models/adapters"]
    # Without runtime updates the sidecar never loads an adapter on a prefill engine.
    off = {**BASE, "loras": {"adapters": [{"name": "a", "pvc": "adapters"}]}}
    assert sidecar_args(off).lora_allowed_dirs is None


def test_stock_vllm_gets_the_env_but_not_our_allowed_dir_flag():
    spec = {
        **BASE,
        "engine": {"image": "vllm:1", "kind": "vllm"},
        "loras": {"runtimeUpdates": True, "adapters": [{"name": "a", "pvc": "adapters"}]},
    }
    for pod in engine_pods(spec).values():
        engine = container(pod, "engine")
        assert not [a for a in engine["command"] if a.startswith("--lora-allowed-dir")]
        assert f"--lora-modules=a={LORA_MOUNT}/a" in engine["command"]
        assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"} in engine["env"]


def test_no_lora_without_the_section():
    for pod in engine_pods(BASE).values():
        config, _ = engine_config(pod)
        assert not config.enable_lora and config.lora_modules == []


ONE = {"name": "a", "path": "/x"}
BAD_SECTIONS = [
    ([], "must be an object"),
    ({}, "must list 1 to"),
    ({"adapters": []}, "must list 1 to"),
    ({"adapters": ["a"]}, "must be an object"),
    ({"adapters": [{"name": "a"}]}, "needs exactly one source: path, pvc or hub"),
    ({"adapters": [{"name": "a", "path": "/x", "pvc": "c"}]}, "exactly one source"),
    ({"adapters": [{"name": "a", "path": "/x", "hub": "o/n"}]}, "(got path, hub)"),
    ({"adapters": [{"name": "a", "path": "rel"}]}, "absolute path"),
    ({"adapters": [{"name": "a", "path": "/x/../etc"}]}, "absolute path (no '..')"),
    ({"adapters": [{"name": "a b", "path": "/x"}]}, "name must be"),
    ({"adapters": [{"name": "a=b", "path": "/x"}]}, "name must be"),
    ({"adapters": [{"name": "org/a", "path": "/x"}]}, "name must be"),
    ({"adapters": [{"name": "..", "path": "/x"}]}, "name must be"),
    ({"adapters": [{"name": "a" * 49, "path": "/x"}]}, "name must be 1-48"),
    ({"adapters": [{"name": 7, "path": "/x"}]}, "name must be"),
    ({"adapters": [{"name": "a", "pvc": "c", "subPath": "../etc"}]}, "subPath"),
    ({"adapters": [{"name": "a", "path": "/x", "subPath": "s"}]}, "subPath"),
    ({"adapters": [ONE, {"name": "a", "path": "/y"}]}, "names must be unique (a twice)"),
    ({"adapters": [ONE, {"name": "A", "path": "/y"}]}, "distinct as volume names"),
    ({"adapters": [{"name": "a", "hub": "org/na me"}]}, "hub must be a Hugging Face repo id"),
    ({"adapters": [{"name": "a", "hub": "org//x"}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": "a/b/c"}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": "../etc"}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": "org/x--y"}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": "org/x;rm"}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": "-org/x"}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": "o/" + "x" * 97}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": ["o/x"]}]}, "hub must be"),
    ({"adapters": [{"name": "a", "hub": "o/x", "revision": "../main"}]}, "revision"),
    ({"adapters": [{"name": "a", "hub": "o/x", "revision": "-f"}]}, "revision"),
    ({"adapters": [{"name": "a", "path": "/x", "revision": "v1"}]}, "revision"),
    ({"adapters": [{"name": "a", "path": "/x", "source": "s3://b"}]}, "unknown fields: source"),
    ({"adapters": [ONE], "maxLoras": 0}, "maxLoras"),
    ({"adapters": [ONE], "maxRank": True}, "maxRank"),
    ({"adapters": [{"name": f"a{i}", "path": "/x"} for i in range(65)]}, "must list 1 to"),
    ({"adapters": [ONE], "runtimeUpdates": "yes"}, "runtimeUpdates must be true or false"),
    ({"adapters": [ONE], "runtimeUpdates": True}, "needs spec.loras.allowedDirs"),
    ({"adapters": [ONE], "allowedDirs": ["/"]}, "not an absolute folder"),
    ({"adapters": [ONE], "allowedDirs": ["rel"]}, "not an absolute folder"),
    ({"adapters": [ONE], "allowedDirs": []}, "allowedDirs must list"),
    ({"adapters": [{**ONE, "rollout": [{"adapter": "zz", "weight": 1}]}]}, "'zz' is not an"),
    ({"adapters": [{**ONE, "rollout": [{"adapter": "a", "weight": 0}]}]}, "weight must be"),
    ({"adapters": [{**ONE, "rollout": [{"adapter": "a"}]}]}, "weight must be"),
    ({"adapters": [{**ONE, "rollout": []}]}, "rollout must list"),
    (
        {"adapters": [{**ONE, "rollout": [{"adapter": "a", "weight": 1}] * 2}]},
        "names an adapter twice",
    ),
]


@pytest.mark.parametrize("section, fragment", BAD_SECTIONS)
def test_bad_sections_are_refused_with_one_line(section, fragment):
    with pytest.raises(SpecError, match=re.escape(fragment)) as err:
        parse_pool_spec(REF.name, {**BASE, "loras": section})
    message = str(err.value)
    assert "\n" not in message and len(message) <= 300


def test_crd_schema_describes_the_section():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    for path in (root / "crds", root / "charts" / "pdpool-operator" / "crds"):
        crd = yaml.safe_load((path / "pdinferencepools.pdpool.io.yaml").read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        section = schema["properties"]["loras"]
        assert section["required"] == ["adapters"]
        assert {"runtimeUpdates", "allowedDirs"} <= set(section["properties"])
        item = section["properties"]["adapters"]["items"]
        assert set(item["properties"]) == {
            "name",
            "path",
            "pvc",
            "subPath",
            "hub",
            "revision",
            "rollout",
        }


# --- the real API server and operator ------------------------------------------------------


def test_the_operator_fails_bad_sections_with_a_condition_and_keeps_going(operator_process, pools):
    cases = {
        "dupes": ({"adapters": [ONE, {"name": "a", "hub": "o/x"}]}, "names must be unique"),
        "hubid": ({"adapters": [{"name": "a", "hub": "o/x y"}]}, "hub must be a Hugging Face"),
        "nosrc": ({"adapters": [{"name": "a"}]}, "needs exactly one source"),
        "twosrc": ({"adapters": [{"name": "a", "pvc": "c", "hub": "o/x"}]}, "(got pvc, hub)"),
        "slash": ({"adapters": [{"name": "x/y", "path": "/x"}]}, "name must be"),
    }
    for name, (section, _) in cases.items():
        pools.create(pool_manifest(name, loras=section))  # the CRD's schema lets it in
    for name, (_, message) in cases.items():
        wait_for(
            lambda name=name: (pools.condition(name, "Ready") or {}).get("reason") == "InvalidSpec",
            30,
            what=f"InvalidSpec on {name}",
        )
        ready = pools.condition(name, "Ready")
        assert ready["status"] == "False" and message in ready["message"], ready
        assert "\n" not in ready["message"]
        assert pools.deployments(name) == {}
    assert operator_process.alive()
    # A good pool next to them: hub adapters fetched by init containers, accepted by the
    # API server (it validates the whole pod template of each Deployment).
    pools.create(
        pool_manifest(
            "good", loras={**HUB, "runtimeUpdates": True, "allowedDirs": ["/models/adapters"]}
        )
    )
    wait_for(lambda: children_exist(pools, "good"), 60, what="the good pool's children")
    for role in ("prefill", "decode"):
        pod = pools.deployments("good")[role].spec.template.spec
        assert [c.name for c in pod.init_containers] == ["fetch-lora-0", "fetch-lora-1"]
        engine = next(c for c in pod.containers if c.name == "engine")
        assert f"--lora-modules=sql={HUB_MOUNT}/sql" in engine.command
        assert "--lora-allowed-dir=/models/adapters" in engine.command
    # Fixing a bad one recovers it without a restart.
    pools.patch_spec("dupes", {"loras": {"adapters": [ONE, {"name": "b", "hub": "o/x"}]}})
    wait_for(lambda: children_exist(pools, "dupes"), 60, what="children after the fix")
