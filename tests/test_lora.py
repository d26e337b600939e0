"""LoRA from real peft + FSDP2 training (2 gloo processes, lora_B non-zero, rank slices split across ranks):
adapters that PeftModel loads, merged weights equal to merge_and_unload, for verl-layout and DCP sources."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import ckpt_writers
import shardmerge
from conftest import leftovers

IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 11]])
FLAGS = {"lora_all_dcp_w2": dict(lora_alpha=16), "lora_rs_w2": dict(lora_alpha=16, lora_rslora=True)}
JOBS = list(ckpt_writers.LORA)


def trained_peft(fsdp_ckpts, job):
    pm = ckpt_writers.make_peft(job)
    pm.load_state_dict(torch.load(fsdp_ckpts / job / "reference.pt"), strict=True)
    return pm.eval()


@pytest.mark.parametrize("job", JOBS)
def test_adapter_reproduces_trained_logits(fsdp_ckpts, tmp_path, job):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src = ckpt_writers.source_of(fsdp_ckpts, job)
    out = tmp_path / "out"
    rep = shardmerge.merge(src, out, dtype="float32", quiet=True, **FLAGS.get(job, {}))
    assert any(n.startswith("LoRA: r=") for n in rep.notes)
    pm = trained_peft(fsdp_ckpts, job)
    # The base is the frozen weights (modules_to_save: the original module), not the trained copy.
    base_sd = load_file(str(out / "model.safetensors"))
    ref = torch.load(fsdp_ckpts / job / "reference.pt")
    assert torch.equal(base_sd["model.layers.0.self_attn.q_proj.weight"], ref["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    if "modules_to_save" in ckpt_writers.LORA[job]["peft"]:
        assert torch.equal(base_sd["lm_head.weight"], ref["base_model.model.lm_head.original_module.weight"])
    # peft's own loader reads the adapter and reproduces the trained model's logits.
    acfg = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    p = ckpt_writers.LORA[job]["peft"]
    assert acfg["r"] == p["r"] and acfg["lora_alpha"] == p["lora_alpha"] and acfg["use_rslora"] == p.get("use_rslora", False)
    assert acfg["use_dora"] == p.get("use_dora", False) and acfg["task_type"] == "CAUSAL_LM"
    assert set(acfg["target_modules"]) == ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
                                           if p["target_modules"] == "all-linear" else set(p["target_modules"]))
    base = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out / "lora_adapter")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, pm(input_ids=IDS).logits)


@pytest.mark.parametrize("job", JOBS)
def test_merged_equals_merge_and_unload(fsdp_ckpts, tmp_path, job):
    src = ckpt_writers.source_of(fsdp_ckpts, job)
    rep = shardmerge.merge(src, tmp_path / "m", dtype="float32", quiet=True, lora="merge", **FLAGS.get(job, {}))
    assert not (tmp_path / "m" / "lora_adapter").exists()
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    want = trained_peft(fsdp_ckpts, job).merge_and_unload().state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1.2e-7, atol=1e-7)  # float32 rounding
    ref = torch.load(fsdp_ckpts / job / "reference.pt")
    frozen = ref["base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight"]
    assert not torch.equal(got["model.layers.1.self_attn.v_proj.weight"], frozen)  # the adapter did something
    assert any("merged into" in n for n in rep.notes)
    # The default dtype: the same float32 result, cast once.
    shardmerge.merge(src, tmp_path / "bf", quiet=True, lora="merge", **FLAGS.get(job, {}))
    bf = load_file(str(tmp_path / "bf" / "model.safetensors"))
    assert all(torch.equal(bf[k], got[k].to(torch.bfloat16)) for k in got)


def test_both_writes_merged_and_adapter(fsdp_ckpts, tmp_path):
    src = ckpt_writers.source_of(fsdp_ckpts, "lora_qv_w2")
    shardmerge.merge(src, tmp_path / "b", dtype="float32", quiet=True, lora="both")
    assert (tmp_path / "b" / "lora_adapter" / "adapter_model.safetensors").exists()
    keys = set(load_file(str(tmp_path / "b" / "lora_adapter" / "adapter_model.safetensors")))
    assert keys == {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in (0, 1) for m in ("q_proj", "v_proj") for ab in "AB"}
    m = json.loads((tmp_path / "b" / "shardmerge.json").read_text())
    assert "lora_adapter/adapter_model.safetensors" in m["files"]


def test_missing_alpha_is_an_error(fsdp_ckpts, tmp_path):
    src = ckpt_writers.source_of(fsdp_ckpts, "lora_rs_w2")  # no lora_train_meta.json
    with pytest.raises(shardmerge.ConversionError, match="LoRA alpha unknown.*--lora-alpha"):
        shardmerge.merge(src, tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists() and leftovers(tmp_path) == []
    with pytest.raises(shardmerge.ConversionError, match="alpha is 0"):
        shardmerge.merge(src, tmp_path / "x", quiet=True, lora_alpha=0)
    with pytest.raises(shardmerge.ConversionError, match="rank 4 .* but the factors have rank \\[8\\]"):
        shardmerge.merge(src, tmp_path / "x", quiet=True, lora_alpha=16, lora_r=4)


def test_lora_only_checkpoint(fsdp_ckpts, tmp_path):
    """verl's save_lora_only: only adapter tensors in the rank files."""
    job = "lora_qv_w2"
    src = tmp_path / "lora_only"
    shutil.copytree(ckpt_writers.source_of(fsdp_ckpts, job), src)
    for r in (0, 1):
        p = src / f"model_world_size_2_rank_{r}.pt"
        sd = torch.load(p, weights_only=False)
        torch.save({k: v for k, v in sd.items() if "lora_" in k}, p)
    out = tmp_path / "adapter"
    shardmerge.merge(src, out, quiet=True)
    assert not (out / "model.safetensors").exists() and (out / "lora_adapter" / "adapter_model.safetensors").exists()
    with pytest.raises(shardmerge.ConversionError, match="LoRA-only checkpoint .* needs --base-model-path"):
        shardmerge.merge(src, tmp_path / "m", quiet=True, lora="merge")
    # With the base model (here: written by an adapter-mode merge of the full checkpoint), the merge works.
    base_dir = tmp_path / "base"
    shardmerge.merge(ckpt_writers.source_of(fsdp_ckpts, job), base_dir, dtype="float32", quiet=True)
    shardmerge.merge(src, tmp_path / "m", dtype="float32", quiet=True, lora="merge", base_model_path=str(base_dir))
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    want = trained_peft(fsdp_ckpts, job).merge_and_unload().state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1.2e-7, atol=1e-7)


def test_lora_mode_on_plain_checkpoint_is_an_error(fsdp_ckpts, tmp_path):
    with pytest.raises(shardmerge.ConversionError, match="holds no LoRA keys"):
        shardmerge.merge(fsdp_ckpts / "fsdp2_w2_llama" / "actor", tmp_path / "x", quiet=True, lora="merge")


def test_verify_merged_output_against_its_source(fsdp_ckpts, tmp_path):
    """verify re-merges the source with the options recorded in the manifest (here --lora merge)."""
    from shardmerge.verify import verify

    src = ckpt_writers.source_of(fsdp_ckpts, "lora_qv_w2")
    shardmerge.merge(src, tmp_path / "m", quiet=True, lora="merge")
    assert json.loads((tmp_path / "m" / "shardmerge.json").read_text())["options"]["lora"] == "merge"
    rep = verify(tmp_path / "m", src)
    assert rep.ok, rep.to_dict()
