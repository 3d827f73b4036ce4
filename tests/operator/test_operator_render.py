"""`pdpool operator render`: the operator's objects for a pool file, without a cluster."""

import pytest
import yaml

from pdpool.cli import build_parser, main
from pdpool.engine.connector.lease_token import load_secret
from pdpool.operator.render import SECRET_PLACEHOLDER

POOL = """\
apiVersion: pdpool.io/v1alpha1
kind: PDInferencePool
metadata: {name: demo}
spec:
  model: {path: /models/q}
  engine: {image: e}
---
apiVersion: pdpool.io/v1alpha1
kind: PDInferencePool
metadata: {name: stock, namespace: llm}
spec:
  model: {path: /models/q}
  engine: {image: v, kind: vllm}
"""


def render(tmp_path, capsys, text=POOL, *extra):
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    code = main(["operator", "render", "-f", str(path), *extra])
    out, err = capsys.readouterr()
    return code, [d for d in yaml.safe_load_all(out) if d], err


def test_render_shows_the_secret_placeholder_and_the_engine_mounts(tmp_path, capsys):
    code, docs, _ = render(tmp_path, capsys, POOL, "-n", "team")
    assert code == 0
    objects = {(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs}
    secret = objects[("Secret", "team", "demo-kv-secret")]
    assert secret["stringData"] == {"kv-secret": SECRET_PLACEHOLDER}
    for role in ("prefill", "decode"):
        pod = objects[("Deployment", "team", f"demo-{role}")]["spec"]["template"]["spec"]
        assert {
            "name": "kv-secret",
            "secret": {
                "secretName": "demo-kv-secret",
                "defaultMode": 0o444,
                "items": [{"key": "kv-secret", "path": "kv-secret"}],
            },
        } in pod["volumes"]
        assert "--kv-secret-file" in pod["containers"][0]["command"]
    # vLLM engines: no Secret, no mount (the pool's metadata namespace wins over -n).
    assert not any(k[0] == "Secret" and k[2].startswith("stock") for k in objects)
    stock = objects[("Deployment", "llm", "stock-decode")]["spec"]["template"]["spec"]
    assert all(v["name"] != "kv-secret" for v in stock["volumes"])


def test_the_placeholder_cannot_become_a_pool_key(tmp_path):
    # Applied by hand, the rendered Secret would stop engines from starting, not sign.
    path = tmp_path / "kv"
    path.write_text(SECRET_PLACEHOLDER)
    with pytest.raises(ValueError, match="too short"):
        load_secret(str(path))


def test_render_errors_are_one_line_exit_2(tmp_path, capsys):
    code, _, err = render(tmp_path, capsys, "kind: ConfigMap\napiVersion: v1\n")
    assert code == 2 and "not a pdpool.io/v1alpha1 PDInferencePool" in err
    code, _, err = render(tmp_path, capsys, POOL.replace("{image: e}", "{}"))
    assert code == 2 and "spec.engine.image is required" in err


def test_running_the_operator_still_parses_without_an_action():
    args = build_parser().parse_args(["operator", "--all-namespaces"])
    assert args.action is None and args.all_namespaces
