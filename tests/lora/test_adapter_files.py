"""Reading PEFT adapter folders without torch (what the HTTP process does): what is
accepted, and every malformed or unsupported folder refused with its reason."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from pdpool.engine.config import EngineConfig
from pdpool.engine.lora.adapter_dir import (
    AdapterError,
    check_against_model,
    linear_shapes,
    read_adapter,
)
from pdpool.engine.lora.registry import LoRARegistry, parse_lora_module


def test_reads_rank_scaling_modules_and_digest(qwen3_adapters, tiny_qwen3):
    alpha = read_adapter(str(qwen3_adapters["alpha"]), 16)
    assert alpha.rank == 8 and alpha.scaling == 2.0  # lora_alpha 16 / r 8
    assert "model.layers.0.self_attn.q_proj" in alpha.modules
    assert alpha.modules["model.layers.1.mlp.down_proj"] == ((8, 128), (64, 8))
    beta = read_adapter(str(qwen3_adapters["beta"]), 16)
    assert {m.rsplit(".", 1)[1] for m in beta.modules} == {"q_proj", "v_proj", "down_proj"}
    assert alpha.digest != beta.digest
    check_against_model(alpha, linear_shapes(str(tiny_qwen3)))


def test_an_adapter_for_another_model_is_refused(qwen3_5_adapters, tiny_qwen3):
    files = read_adapter(str(qwen3_5_adapters["alpha"]), 16)
    with pytest.raises(AdapterError, match=r"no layer|maps"):
        check_against_model(files, linear_shapes(str(tiny_qwen3)))


def _copy(src, tmp_path, name="a"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes,why",
    [
        ({"r": 0}, "positive integer"),
        ({"r": "8"}, "positive integer"),
        ({"r": 64}, "--max-lora-rank"),
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
        ({"target_modules": ["embed_tokens"]}, "not supported"),
        ({"r": 4}, "rank"),  # the weights say 8
    ],
)
def test_bad_configs_are_refused(qwen3_adapters, tmp_path, changes, why):
    folder = _copy(qwen3_adapters["alpha"], tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(AdapterError, match=why):
        read_adapter(str(folder), 32)


def test_bad_files_are_refused(qwen3_adapters, tmp_path):
    src = qwen3_adapters["alpha"]
    with pytest.raises(AdapterError, match="not a directory"):
        read_adapter(str(tmp_path / "missing"), 16)
    no_config = _copy(src, tmp_path, "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"adapter_config\.json is missing"):
        read_adapter(str(no_config), 16)
    listed = _copy(src, tmp_path, "listed")
    (listed / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="JSON object"):
        read_adapter(str(listed), 16)
    no_weights = _copy(src, tmp_path, "no_weights")
    (no_weights / "adapter_model.safetensors").rename(no_weights / "adapter_model.bin")
    with pytest.raises(AdapterError, match="only safetensors"):
        read_adapter(str(no_weights), 16)
    huge_header = _copy(src, tmp_path, "huge_header")
    (huge_header / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(AdapterError, match="bad header length"):
        read_adapter(str(huge_header), 16)
    foreign = _copy(src, tmp_path, "foreign")
    header = json.dumps(
        {"model.embed.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    )
    (foreign / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header.encode() + b"\0" * 4
    )
    with pytest.raises(AdapterError, match="unexpected tensor"):
        read_adapter(str(foreign), 16)
    lying = _copy(src, tmp_path, "lying")
    header = json.dumps(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
                "dtype": "F32",
                "shape": [8, 64],
                "data_offsets": [0, 1 << 30],
            }
        }
    )
    (lying / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header.encode()
    )
    with pytest.raises(AdapterError, match="outside the file"):
        read_adapter(str(lying), 16)


def test_lora_modules_forms():
    assert parse_lora_module("a=/x/y").path == "/x/y"
    module = parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}')
    assert (module.name, module.path, module.base_model_name) == ("b", "/p", "m")
    for bad in ("nopath", "=/p", "a=", '{"name": 1, "path": "/p"}', "{bad json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


def test_lora_flags_are_checked(tiny_qwen3):
    def config(**kw):
        return EngineConfig(model=str(tiny_qwen3), **kw)

    with pytest.raises(ValueError, match="needs --enable-lora"):
        config(lora_modules=["a=/p"]).validate()
    with pytest.raises(ValueError, match="--max-loras"):
        config(enable_lora=True, max_loras=0).validate()
    with pytest.raises(ValueError, match="--max-lora-rank"):
        config(enable_lora=True, max_lora_rank=0).validate()
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        config(enable_lora=True, max_loras=4, max_cpu_loras=2).validate()
    with pytest.raises(ValueError, match="--lora-modules"):
        config(enable_lora=True, lora_modules=["oops"]).validate()


def test_registry_ids_names_and_runtime_paths(qwen3_adapters, tmp_path):
    registry = LoRARegistry("base", 16, allowed_dirs=(str(tmp_path),))
    a = registry.add("a", registry.check_new("a", str(qwen3_adapters["alpha"]), dynamic=False))
    b = registry.add("b", registry.check_new("b", str(qwen3_adapters["beta"]), dynamic=False))
    assert (a.lora_id, b.lora_id) == (1, 2)
    assert a.hash_key != b.hash_key
    with pytest.raises(AdapterError, match="already been loaded"):
        registry.check_new("a", str(qwen3_adapters["alpha"]), dynamic=False)
    with pytest.raises(AdapterError, match="base model"):
        registry.check_new("base", str(qwen3_adapters["alpha"]), dynamic=False)
    with pytest.raises(AdapterError, match="outside --lora-allowed-dir"):
        registry.check_new("c", str(qwen3_adapters["alpha"]), dynamic=True)
    link = tmp_path / "link"
    link.symlink_to(qwen3_adapters["alpha"])  # a link out of the allowed folder
    with pytest.raises(AdapterError, match="outside --lora-allowed-dir"):
        registry.check_new("c", str(link), dynamic=True)
    closed = LoRARegistry("base", 16)
    with pytest.raises(AdapterError, match="needs --lora-allowed-dir"):
        closed.check_new("c", str(qwen3_adapters["alpha"]), dynamic=True)
    registry.remove("a")
    with pytest.raises(AdapterError, match="cannot be found"):
        registry.remove("a")
    assert registry.names() == ["b"]
