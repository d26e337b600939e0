"""DCP folders (plain, flat, accelerate), Lightning checkpoints (ModelParallelStrategy, FSDPStrategy, single file),
and MoE models: merged output equals what save_pretrained writes for the trained model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_writers
import shardmerge
from conftest import leftovers

HERE = Path(__file__).parent


def load_dir(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def saved_by_transformers(family: str, state_dict: dict, folder: Path) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for the trained weights: the ground truth for names, layout and values."""
    model = ckpt_writers.make_model(family)
    model.load_state_dict(state_dict)
    model.save_pretrained(str(folder))
    return load_dir(folder)


@pytest.mark.parametrize("job", ["dcp_w2_llama", "dcp_flat_w2_qwen3", "accelerate_w2_qwen2", "moe_w2_qwen3moe", "moe_w2_mixtral"])
def test_equals_save_pretrained_of_trained_model(fsdp_ckpts, tmp_path, job):
    family = ckpt_writers.JOBS[job][0]
    want = saved_by_transformers(family, torch.load(fsdp_ckpts / job / "reference.pt"), tmp_path / "sp")
    src = ckpt_writers.source_of(fsdp_ckpts, job)
    rep = shardmerge.merge(src, tmp_path / "out", dtype="source", quiet=True)
    got = load_dir(tmp_path / "out")
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    bf = shardmerge.merge(src, tmp_path / "bf16", quiet=True)
    got = load_dir(tmp_path / "bf16")
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert bf.tensors == rep.tensors == len(want)


def test_moe_layouts_and_logits(fsdp_ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    for job, per_expert in (("moe_w2_qwen3moe", "model.layers.1.mlp.experts.3.down_proj.weight"),
                            ("moe_w2_mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight")):
        out = tmp_path / job
        rep = shardmerge.merge(ckpt_writers.source_of(fsdp_ckpts, job), out, dtype="float32", quiet=True)
        assert any("fused tensors written as" in n for n in rep.notes)
        idx = set(load_dir(out))
        assert per_expert in idx and not any("gate_up_proj" in k for k in idx)
        # The fused expert dim was sharded across the 2 ranks (2 experts each): the report says so.
        assert rep.world_size == 2
        family = ckpt_writers.JOBS[job][0]
        ref = torch.load(fsdp_ckpts / job / "reference.pt")
        assert ref["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
        original = AutoModelForCausalLM.from_config(ckpt_writers.make_config(family), dtype=torch.float32).eval()
        original.load_state_dict(ref)
        merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        ids = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9]])
        with torch.no_grad():
            assert torch.equal(merged(input_ids=ids).logits, original(input_ids=ids).logits)


def test_dcp_optimizer_entries_never_read(fsdp_ckpts, tmp_path):
    job = tmp_path / "dcp"
    # A DCP folder holding model and optimizer state, as trainers save it.
    shutil.copytree(fsdp_ckpts / "dcp_w2_llama" / "actor", job)
    rep = shardmerge.inspect(job)
    assert rep.format == "dcp" and rep.world_size == 2
    from shardmerge.formats.base import FilePool
    from shardmerge.formats.dcp import read_dcp

    ck = read_dcp(job, FilePool(), lambda n: None)
    assert all(k.startswith("model.") for k in ck.tensors)


def test_dcp_incomplete_and_damaged(fsdp_ckpts, tmp_path):
    src = tmp_path / "dcp"
    shutil.copytree(fsdp_ckpts / "dcp_w2_llama" / "actor", src)
    (src / ".metadata").rename(tmp_path / "metadata.bak")
    with pytest.raises(shardmerge.SourceError, match="no .metadata: the checkpoint is still being written"):
        shardmerge.merge(src, tmp_path / "out", quiet=True)
    (tmp_path / "metadata.bak").rename(src / ".metadata")
    (src / "__1_0.distcp").rename(tmp_path / "part.bak")
    with pytest.raises(shardmerge.SourceError, match=r"names __1_0.distcp, which is missing"):
        shardmerge.merge(src, tmp_path / "out", quiet=True)
    data = (tmp_path / "part.bak").read_bytes()
    (src / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    with pytest.raises(shardmerge.SourceError, match=r"__1_0.distcp is truncated"):
        shardmerge.merge(src, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_accelerate_trainer_folder(fsdp_ckpts):
    rep = shardmerge.inspect(fsdp_ckpts / "accelerate_w2_qwen2" / "checkpoint-5")
    assert rep.source.endswith("checkpoint-5/pytorch_model_fsdp_0")
    assert "pytorch_model_fsdp_0/ -> that subfolder" in rep.discovery[0]
    assert rep.config_dir.endswith("checkpoint-5") and rep.step == 5


# -- Lightning ---------------------------------------------------------------------------------------------------


def run_lightning(out: Path, mode: str, *extra: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    p = subprocess.run([sys.executable, str(HERE / "lightning_writers.py"), str(out), mode, *extra],
                       capture_output=True, text=True, env=env, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"lightning run failed ({mode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


@pytest.fixture(scope="session")
def lightning_ckpts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning")
    for mode in ("mp", "fsdp", "single"):
        run_lightning(out / mode, mode)
    ckpt_writers.write_hf_side(out / "hf", ckpt_writers.make_config("qwen2"))
    return out


@pytest.mark.parametrize("mode,prefix", [("mp", "state_dict.model."), ("fsdp", "model.model."), ("single", "model.")])
def test_lightning_checkpoints(lightning_ckpts, tmp_path, mode, prefix):
    ckpt = lightning_ckpts / mode / "ckpts" / "epoch=0-step=4.ckpt"
    rep = shardmerge.merge(ckpt, tmp_path / "out", dtype="source", quiet=True, hf_model_config_path=str(lightning_ckpts / "hf"))
    want = saved_by_transformers("qwen2", torch.load(lightning_ckpts / mode / "reference-step=4.pt"), tmp_path / "sp")
    got = load_dir(tmp_path / "out")
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert any(f"stripped prefix '{prefix}'" in n for n in rep.notes)
    assert rep.format == ("lightning" if mode == "single" else "dcp")
    if mode != "single":
        assert "Lightning sharded checkpoint" in rep.reason and rep.world_size == 2
        assert any("optimizer entries" in n for n in rep.notes)
    # Default target: a sibling named after the checkpoint.
    assert shardmerge.inspect(ckpt, hf_model_config_path=str(lightning_ckpts / "hf")).target.endswith("epoch=0-step=4_hf")


def test_lightning_single_file_hparams_need_no_trust(lightning_ckpts):
    """save_hyperparameters() of an OmegaConf config: torch.load(weights_only=True) fails on it; we do not."""
    ckpt = lightning_ckpts / "single" / "ckpts" / "epoch=0-step=4.ckpt"
    with pytest.raises(Exception, match="DictConfig|Unsupported global"):
        torch.load(ckpt, weights_only=True)
    rep = shardmerge.inspect(ckpt, hf_model_config_path=str(lightning_ckpts / "hf"))
    assert rep.tensors == 26 and rep.step == 4
