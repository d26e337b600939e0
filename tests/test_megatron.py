"""Megatron: torch_dist and legacy checkpoints written by megatron-core on CPU (TP=2, PP=2, TP=2 x PP=2, EP=2;
GQA, explicit kv_channels, padded vocabulary, tied and untied), merged without megatron and compared with the HF
model the weights came from and with Megatron's own forward."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import megatron_writers as mw
import shardmerge
from conftest import leftovers

JOBS = list(mw.JOBS)


@pytest.fixture(scope="session")
def megatron_ckpts(tmp_path_factory) -> Path:
    import os

    reuse = os.environ.get("SHARDMERGE_MEGATRON_FIXTURES")
    if reuse and all((Path(reuse) / j / "logits.pt").exists() for j in JOBS):
        return Path(reuse)
    out = tmp_path_factory.mktemp("megatron")
    mw.build(out)
    return out


def load_dir(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check_against_hf_and_megatron(out: Path, job_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    want = load_dir(job_dir / "hf")
    got = load_dir(out)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=mw.TOKENS).logits
    torch.testing.assert_close(logits, torch.load(job_dir / "logits.pt"), rtol=0, atol=1e-5)


@pytest.mark.parametrize("job", JOBS)
def test_torch_dist_run_root(megatron_ckpts, tmp_path, job):
    out = tmp_path / "out"
    rep = shardmerge.merge(megatron_ckpts / job / "torch_dist", out, dtype="source", quiet=True,
                           hf_model_config_path=str(megatron_ckpts / job / "hf"))
    assert rep.format == "megatron" and rep.step == 100 and "Megatron markers" in rep.reason
    assert rep.discovery == ["latest_checkpointed_iteration.txt says 100 -> iter_0000100"]
    check_against_hf_and_megatron(out, megatron_ckpts / job)
    assert (out / "tokenizer.json").exists()


@pytest.mark.parametrize("job", JOBS)
def test_legacy_tree_with_config_beside_run_root(megatron_ckpts, tmp_path, job):
    root = tmp_path / "legacy"
    shutil.copytree(megatron_ckpts / job / "legacy", root)
    shutil.copytree(megatron_ckpts / job / "hf", root / "huggingface")  # as verl keeps it, beside iter_*
    out = tmp_path / "out"
    rep = shardmerge.merge(root, out, dtype="source", quiet=True)
    assert rep.config_dir == str(root / "huggingface")
    assert any("legacy checkpoint" in n for n in rep.notes)
    spec = mw.JOBS[job]
    assert rep.mesh == f"(tp={spec['tp']}, pp={spec['pp']}, ep={spec['ep']})"
    check_against_hf_and_megatron(out, megatron_ckpts / job)


@pytest.mark.parametrize("job", ["mg_tp2_qwen2", "mg_tp2pp2_qwen3", "mg_ep2_qwen3moe"])
def test_config_synthesized_from_megatron_args(megatron_ckpts, tmp_path, job):
    out = tmp_path / "out"
    rep = shardmerge.merge(megatron_ckpts / job / "torch_dist", out, dtype="float32", quiet=True)
    assert any("synthesized from the Megatron arguments" in n for n in rep.notes)
    assert any("padded vocabulary" in n for n in rep.notes) == (mw.JOBS[job]["vocab_pad"] != json.loads((megatron_ckpts / job / "hf" / "config.json").read_text())["vocab_size"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=mw.TOKENS).logits, torch.load(megatron_ckpts / job / "logits.pt"), rtol=0, atol=1e-5)


def test_verl_megatron_layouts(megatron_ckpts, tmp_path):
    job = megatron_ckpts / "mg_tp2_qwen2"
    it = job / "torch_dist" / "iter_0000100"
    v1 = tmp_path / "v1" / "global_step_5" / "actor"  # dist_ckpt/ + huggingface/ at the checkpoint root
    shutil.copytree(it, v1 / "dist_ckpt")
    shutil.copytree(job / "hf", v1 / "huggingface")
    v2 = tmp_path / "v2" / "global_step_5" / "actor"  # model/dist_ckpt/ + model/huggingface/ + ckpt_contents.json
    shutil.copytree(it, v2 / "model" / "dist_ckpt")
    shutil.copytree(job / "hf", v2 / "model" / "huggingface")
    (v2 / "ckpt_contents.json").write_text(json.dumps({"model": {"format": "megatron_dist_ckpt", "path": "model/dist_ckpt"}}))
    for root in (v1, v2):
        (root.parent.parent / "latest_checkpointed_iteration.txt").write_text("5")
        out = tmp_path / f"{root.parent.parent.name}-out"
        rep = shardmerge.merge(root.parent.parent, out, dtype="source", quiet=True)
        assert rep.format == "megatron" and rep.role == "actor" and rep.step == 5
        check_against_hf_and_megatron(out, job)


def test_incomplete_save_refused(megatron_ckpts, tmp_path):
    it = tmp_path / "iter_0000100"
    shutil.copytree(megatron_ckpts / "mg_pp2_llama" / "torch_dist" / "iter_0000100", it)
    (it / "metadata.json").unlink()
    with pytest.raises(shardmerge.SourceError, match="no metadata.json: the Megatron save is still in progress"):
        shardmerge.merge(it, tmp_path / "out", quiet=True, hf_model_config_path=str(megatron_ckpts / "mg_pp2_llama" / "hf"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_legacy_missing_rank_named(megatron_ckpts, tmp_path):
    it = tmp_path / "iter_0000100"
    shutil.copytree(megatron_ckpts / "mg_tp2pp2_qwen3" / "legacy" / "iter_0000100", it)
    shutil.rmtree(it / "mp_rank_01_001")
    with pytest.raises(shardmerge.SourceError, match="missing for tp=2 pp=2 ep=1: mp_rank_01_001"):
        shardmerge.merge(it, tmp_path / "out", quiet=True)


def test_tie_contradiction(megatron_ckpts, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(megatron_ckpts / "mg_tp2_qwen2" / "hf", hf)  # trained tied: no output_layer
    cfg = json.loads((hf / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(shardmerge.ConversionError, match="no output_layer .* tie_word_embeddings=false"):
        shardmerge.merge(megatron_ckpts / "mg_tp2_qwen2" / "torch_dist", tmp_path / "out", quiet=True, hf_model_config_path=str(hf))


def _legacy_with_extra_key(megatron_ckpts, tmp_path, key):
    it = tmp_path / "iter_0000100"
    shutil.copytree(megatron_ckpts / "mg_pp2_llama" / "legacy" / "iter_0000100", it)
    for f in it.glob("mp_rank_*/model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)
        obj["model"][key] = torch.ones(32)
        torch.save(obj, f)
    return it


def test_mtp_layers_dropped_or_kept(megatron_ckpts, tmp_path):
    it = _legacy_with_extra_key(megatron_ckpts, tmp_path, "mtp.layers.0.enorm.weight")
    hf = str(megatron_ckpts / "mg_pp2_llama" / "hf")
    rep = shardmerge.merge(it, tmp_path / "a", quiet=True, hf_model_config_path=hf)
    assert any("dropped 1 multi-token-prediction" in n for n in rep.notes)
    assert "mtp.layers.0.enorm.weight" not in load_dir(tmp_path / "a")
    rep = shardmerge.merge(it, tmp_path / "b", quiet=True, hf_model_config_path=hf, keep_mtp=True)
    assert "mtp.layers.0.enorm.weight" in load_dir(tmp_path / "b")
    assert any("declared additions" in n for n in rep.notes)


def test_unknown_megatron_key_is_an_error(megatron_ckpts, tmp_path):
    it = _legacy_with_extra_key(megatron_ckpts, tmp_path, "decoder.layers.0.mystery.weight")
    with pytest.raises(shardmerge.ConversionError, match="Megatron keys this converter does not know: decoder.layers.0.mystery.weight"):
        shardmerge.merge(it, tmp_path / "x", quiet=True, hf_model_config_path=str(megatron_ckpts / "mg_pp2_llama" / "hf"))


def test_save_hook_waits_for_finalized_saves(megatron_ckpts, tmp_path):
    from shardmerge.background import read_status
    from shardmerge.hooks import megatron as hook

    save = tmp_path / "save"
    save.mkdir()
    shutil.copytree(megatron_ckpts / "mg_pp2_llama" / "hf", save / "huggingface")
    src = megatron_ckpts / "mg_pp2_llama" / "torch_dist" / "iter_0000100"
    # iteration 10: a normal save (files, then tracker), then the hook
    shutil.copytree(src, save / "iter_0000010")
    (save / "latest_checkpointed_iteration.txt").write_text("10")
    hook.merge_after_save(save, 10, dtype="float32", poll_interval=0.2)
    # iteration 20: an async save; the hook runs before it is finalized
    shutil.copytree(src, save / "iter_0000020", ignore=shutil.ignore_patterns("metadata.json"))
    hook.merge_after_save(save, 20)
    import time

    time.sleep(1.0)
    assert read_status(save / "iter_0000020_hf") is None  # not finalized: not submitted
    shutil.copy(src / "metadata.json", save / "iter_0000020" / "metadata.json")
    (save / "latest_checkpointed_iteration.txt").write_text("20")
    sts = hook.finish(timeout=300)
    assert [s["state"] for s in sts] == ["done", "done"]
    for it in (10, 20):
        check_against_hf_and_megatron(save / f"iter_{it:07d}_hf", megatron_ckpts / "mg_pp2_llama")


def test_install_wraps_megatron_lm_save(monkeypatch, tmp_path):
    """With Megatron-LM present, install() wraps its save_checkpoint; the wrapper calls the hook after the save."""
    from shardmerge.hooks import megatron as hook

    calls = []
    ckpt_mod = types.ModuleType("megatron.training.checkpointing")
    ckpt_mod.save_checkpoint = lambda iteration, *a, **k: calls.append(("save", iteration))
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: types.SimpleNamespace(save=str(tmp_path))
    training.checkpointing = ckpt_mod
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", ckpt_mod)
    monkeypatch.setattr(hook, "merge_after_save", lambda save, it, **kw: calls.append(("merge", save, it, kw)))
    assert hook.install(dtype="bfloat16") is True
    ckpt_mod.save_checkpoint(7, "model")
    assert calls == [("save", 7), ("merge", str(tmp_path), 7, {"dtype": "bfloat16"})]


def test_watch_follows_megatron_roots(megatron_ckpts, tmp_path):
    from shardmerge.watch import watch

    root = tmp_path / "run"
    shutil.copytree(megatron_ckpts / "mg_tp2_qwen2" / "torch_dist", root)
    shutil.copytree(megatron_ckpts / "mg_tp2_qwen2" / "hf", root / "huggingface")
    res = watch(root, shardmerge.MergeConfig(dtype="source"), once=True)
    assert [Path(r["target"]).name for r in res] == ["iter_0000100_hf"] and res[0]["state"] == "done"
    check_against_hf_and_megatron(root / "iter_0000100_hf", megatron_ckpts / "mg_tp2_qwen2")
