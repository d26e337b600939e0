"""Where checkpoints and configs are found: run roots, verl roles, SFT layout, config search order."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import shardmerge
from shardmerge.formats import locate


def make_run(tmp_path, fsdp_ckpts, steps=(10, 20), roles=("actor", "critic")):
    root = tmp_path / "run"
    for s in steps:
        for r in roles:
            shutil.copytree(fsdp_ckpts / "fsdp2_w2_llama" / "actor", root / f"global_step_{s}" / r)
    (root / "latest_checkpointed_iteration.txt").write_text(str(steps[-1]))
    return root


def test_run_root_means_latest_step_and_all_roles(fsdp_ckpts, tmp_path):
    root = make_run(tmp_path, fsdp_ckpts)
    locs = locate(root)
    assert [(l.role, l.path.parent.name, l.step) for l in locs] == [("actor", "global_step_20", 20), ("critic", "global_step_20", 20)]
    assert "latest_checkpointed_iteration.txt says 20 -> global_step_20" in locs[0].chain
    out = tmp_path / "out"
    rep = shardmerge.merge(root, out, quiet=True)
    assert set(rep.roles) == {"actor", "critic"}
    assert (out / "actor" / "shardmerge.json").exists() and (out / "critic" / "shardmerge.json").exists()
    assert json.loads((out / "actor" / "shardmerge.json").read_text())["step"] == 20


def test_role_selects_one(fsdp_ckpts, tmp_path):
    root = make_run(tmp_path, fsdp_ckpts)
    out = tmp_path / "out"
    rep = shardmerge.merge(root, out, quiet=True, role="critic")
    assert rep.role == "critic" and (out / "model.safetensors").exists()
    with pytest.raises(shardmerge.SourceError, match="no 'reward' folder"):
        shardmerge.merge(root, tmp_path / "x", quiet=True, role="reward")


def test_default_target_is_sibling(fsdp_ckpts, tmp_path):
    root = make_run(tmp_path, fsdp_ckpts, steps=(5,), roles=("actor",))
    rep = shardmerge.merge(root / "global_step_5" / "actor", quiet=True)
    assert rep.target == str(root / "global_step_5" / "actor_hf")
    assert (root / "global_step_5" / "actor_hf" / "model.safetensors").exists()


def test_tracker_naming_missing_step(fsdp_ckpts, tmp_path):
    root = make_run(tmp_path, fsdp_ckpts, steps=(5,), roles=("actor",))
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(shardmerge.SourceError, match="names step 7"):
        shardmerge.merge(root, tmp_path / "x", quiet=True)


def test_sft_layout_rank_files_in_step_folder(fsdp_ckpts, tmp_path):
    """verl's SFT trainer writes rank files and huggingface/ directly into global_step_N/."""
    step = tmp_path / "sft" / "global_step_3"
    shutil.copytree(fsdp_ckpts / "fsdp2_w2_qwen3" / "actor", step)
    (step.parent / "latest_checkpointed_iteration.txt").write_text("3")
    rep = shardmerge.merge(step.parent, tmp_path / "out", quiet=True, dtype="source")
    assert rep.step == 3 and rep.format == "fsdp"
    ref = torch.load(fsdp_ckpts / "fsdp2_w2_qwen3" / "reference.pt")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in ref.items())


def test_config_search_order(fsdp_ckpts, tmp_path):
    src = tmp_path / "ckpt" / "actor"
    shutil.copytree(fsdp_ckpts / "fsdp2_w2_llama" / "actor", src)
    hf = src / "huggingface"
    # <dir>/config.json when there is no huggingface/ folder
    shutil.move(str(hf), str(tmp_path / "hfcopy"))
    for f in (tmp_path / "hfcopy").iterdir():
        shutil.copy(f, src / f.name)
    rep = shardmerge.inspect(src)
    assert rep.config_dir == str(src)
    # one level up: <parent>/huggingface/
    for f in (tmp_path / "hfcopy").iterdir():
        (src / f.name).unlink()
    shutil.copytree(tmp_path / "hfcopy", src.parent / "huggingface")
    assert shardmerge.inspect(src).config_dir == str(src.parent / "huggingface")
    # an explicit path wins
    assert shardmerge.inspect(src, hf_model_config_path=str(tmp_path / "hfcopy")).config_dir == str(tmp_path / "hfcopy")
    with pytest.raises(shardmerge.ConfigNotFoundError, match="no config.json there"):
        shardmerge.inspect(src, hf_model_config_path=str(tmp_path))


def test_backend_mismatch(fsdp_ckpts, tmp_path):
    rep = shardmerge.inspect(fsdp_ckpts / "fsdp2_w2_llama" / "actor", backend="dcp")
    assert rep.format == "fsdp" and "--backend dcp given; read as fsdp" in rep.reason
    with pytest.raises(shardmerge.SourceError, match="--backend megatron given but the folder looks like fsdp"):
        shardmerge.inspect(fsdp_ckpts / "fsdp2_w2_llama" / "actor", backend="megatron")
