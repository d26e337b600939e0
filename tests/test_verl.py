"""verl: genuine FSDPCheckpointManager checkpoints, equality with verl's own merger, the merge_on_save hook through
verl's real save path, `watch`, `verify`/`test`, hub upload and verl's CLI spellings."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardmerge
from shardmerge.background import read_status
from shardmerge.verify import compare_dirs, merge_and_compare, verify

HERE = Path(__file__).parent
STUBS = str(HERE / "stubs")
VERL_JOBS = {"verl_fsdp2_w2": "actor", "verl_fsdp1_w2": "actor", "verl_hsdp_w4": "actor", "verl_critic_w2": "critic"}


def env(**extra) -> dict:
    path = [str(HERE)]
    try:
        import ray  # noqa: F401
    except ImportError:
        path.insert(0, STUBS)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path), **extra}


def load_dir(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="session")
def verl_ckpts(tmp_path_factory) -> Path:
    """Genuine verl checkpoints, plus verl's own merger's output for each (run concurrently)."""
    out = tmp_path_factory.mktemp("verl")
    p = subprocess.run([sys.executable, str(HERE / "verl_writers.py"), str(out), *VERL_JOBS], env=env(),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    procs = []
    for job, role in VERL_JOBS.items():
        cmd = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir",
               str(out / job / "global_step_2" / role), "--target_dir", str(out / f"{job}.verl")]
        procs.append((job, subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for job, proc in procs:
        o, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"verl merger failed on {job}:\n{o[-3000:]}"
    return out


@pytest.mark.parametrize("job", list(VERL_JOBS))
def test_equals_verl_model_merger(verl_ckpts, tmp_path, job):
    role = VERL_JOBS[job]
    out = tmp_path / "out"
    rep = shardmerge.merge(verl_ckpts / job, out, quiet=True)  # the run root: latest step, its one role
    assert rep.role == role and rep.step == 2
    ours, theirs = load_dir(out), load_dir(verl_ckpts / f"{job}.verl")
    assert set(ours) == set(theirs)
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    ref = torch.load(verl_ckpts / job / "reference.pt")
    for k, v in ref.items():
        if k in ours:
            assert torch.equal(ours[k], v.to(torch.bfloat16)), k
    v = compare_dirs(out, verl_ckpts / f"{job}.verl")
    assert v.ok, v.to_dict()
    assert "same tokens" in v.tokenizer or v.tokenizer == "identical files"
    if role == "critic":
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen2ForTokenClassification"] and ours["score.weight"].shape == (1, 32)


def test_value_model_flag_on_causal_config(verl_ckpts, tmp_path):
    """--is-value-model: a critic whose config names the CausalLM class is written as ForTokenClassification."""
    src = tmp_path / "critic"
    shutil.copytree(verl_ckpts / "verl_critic_w2" / "global_step_2" / "critic", src)
    cfgp = src / "huggingface" / "config.json"
    cfg = json.loads(cfgp.read_text())
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    cfg.pop("num_labels", None)
    cfg.pop("id2label", None)
    cfg.pop("label2id", None)
    cfgp.write_text(json.dumps(cfg))
    with pytest.raises(shardmerge.ConversionError, match="score.weight"):
        shardmerge.merge(src, tmp_path / "x", quiet=True)
    shardmerge.merge(src, tmp_path / "out", quiet=True, is_value_model=True)
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["architectures"] == ["Qwen2ForTokenClassification"] and out_cfg["num_labels"] == 1
    from transformers import AutoModelForTokenClassification

    m = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "out"))
    assert m.score.weight.shape == (1, 32)


def test_tie_word_embedding_flag_checked(verl_ckpts, tmp_path):
    src = verl_ckpts / "verl_fsdp1_w2"  # llama, untied
    with pytest.raises(shardmerge.ConversionError, match="contradicts the config"):
        shardmerge.merge(src, tmp_path / "x", quiet=True, tie_word_embedding=True)
    p = subprocess.run([sys.executable, "-m", "shardmerge", "merge", "--backend", "fsdp", "--local_dir", str(src),
                        "--target_dir", str(tmp_path / "y"), "--tie-word-embedding"], capture_output=True, text=True, env=env())
    assert p.returncode == 1 and "contradicts the config" in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "y").exists()


# -- the hook --------------------------------------------------------------------------------------------------------


def drive(root: Path, flag: str, steps: int = 2) -> dict:
    p = subprocess.run([sys.executable, str(HERE / "verl_hook_driver.py"), str(root), flag, str(steps)],
                       capture_output=True, text=True, env=env(), timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    return {k: v for d in lines for k, v in d.items()}


def test_merge_on_save_hook(tmp_path):
    out = drive(tmp_path, "true")
    assert out["patched"] is True
    ckpts = tmp_path / "ckpts"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert [s["state"] for s in out["statuses"]] == ["done"] * 4
    for step in (1, 2):
        for role in ("actor", "critic"):
            target = ckpts / f"global_step_{step}" / f"{role}_hf"
            ref = torch.load(tmp_path / f"reference-{role}-step{step}.pt")
            got = load_dir(target)
            if role == "actor":
                ref.pop("lm_head.weight")  # tied
            assert set(got) == set(ref) and all(torch.equal(got[k], v) for k, v in ref.items()), (step, role)
            assert json.loads((target / "shardmerge.json").read_text())["source"] == str(ckpts / f"global_step_{step}" / role)
    assert not any(ckpts.rglob(".shardmerge-pins"))


@pytest.mark.parametrize("flag", ["false", "unset"])
def test_merge_on_save_off_does_nothing(tmp_path, flag):
    out = drive(tmp_path, flag, steps=1)
    assert out["patched"] is True and out["statuses"] == []
    assert not list((tmp_path / "ckpts").rglob("*_hf*"))


# -- watch -----------------------------------------------------------------------------------------------------------


def test_watch_once_merges_only_complete_checkpoints(fsdp_ckpts, tmp_path):
    from shardmerge.watch import watch

    root = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(fsdp_ckpts / "fsdp2_w2_llama" / "actor", root / f"global_step_{s}" / "actor")
    (root / "latest_checkpointed_iteration.txt").write_text("1")  # step 2 is still being written
    dcp_half = tmp_path / "run" / "other" / "epoch=0-step=5.ckpt"
    shutil.copytree(fsdp_ckpts / "dcp_w2_llama" / "actor", dcp_half)
    (dcp_half / ".metadata").unlink()  # DCP writes .metadata last: this one is half-written
    res = watch(root, once=True)
    assert [r["target"] for r in res] == [str(root / "global_step_1" / "actor_hf")] and res[0]["state"] == "done"
    assert not (root / "global_step_2" / "actor_hf").exists() and not (root / "other" / "epoch=0-step=5_hf").exists()
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    res = watch(root, once=True)  # restart-safe: step 1 is not merged again
    assert [r["target"] for r in res] == [str(root / "global_step_2" / "actor_hf")]
    assert watch(root, once=True) == []


def test_watch_follows_checkpoints_as_they_appear(fsdp_ckpts, tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    cmd = [sys.executable, "-m", "shardmerge", "watch", str(root), "--interval", "0.3", "--json", "--dtype", "float32"]
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        second = subprocess.run(cmd[:5] + ["--once"], env=env(), capture_output=True, text=True)
        assert second.returncode == 1 and "another shardmerge watch" in second.stderr
        for n in (1, 2):
            dst = root / f"epoch=0-step={n}.ckpt"
            shutil.copytree(fsdp_ckpts / "dcp_w2_llama" / "actor", root / f".tmp{n}")
            (root / f".tmp{n}").rename(dst)
            target = root / f"epoch=0-step={n}_hf"
            deadline = time.time() + 120
            while time.time() < deadline and (read_status(target) or {}).get("state") != "done":
                time.sleep(0.2)
            assert read_status(target)["state"] == "done"
            ref = torch.load(fsdp_ckpts / "dcp_w2_llama" / "reference.pt")
            got = load_dir(target)
            assert all(torch.equal(got[k], v) for k, v in ref.items())
    finally:
        p.send_signal(signal.SIGTERM)
        o, e = p.communicate(timeout=60)
    assert p.returncode == 0, e
    lines = [json.loads(x) for x in o.splitlines() if x.startswith("{")]
    assert [Path(x["target"]).name for x in lines] == ["epoch=0-step=1_hf", "epoch=0-step=2_hf"]


# -- verify / test -----------------------------------------------------------------------------------------------------


def test_verify_catches_value_missing_and_extra_keys(verl_ckpts, tmp_path):
    a = tmp_path / "a"
    shardmerge.merge(verl_ckpts / "verl_fsdp2_w2", a, quiet=True)
    assert verify(a, a).ok
    # the merged folder against its own source checkpoint
    assert verify(a, verl_ckpts / "verl_fsdp2_w2" / "global_step_2" / "actor").ok

    def variant(name, change):
        d = tmp_path / name
        shutil.copytree(a, d)
        t = load_file(str(d / "model.safetensors"))
        change(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    def bump(t):
        w = t["model.norm.weight"].clone()
        w[0] += 1
        t["model.norm.weight"] = w

    r = verify(a, variant("changed", bump))
    assert not r.ok and r.value_mismatch == ["model.norm.weight"]
    r = verify(a, variant("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))
    assert not r.ok and r.missing_in_b == ["model.layers.1.mlp.up_proj.weight"]
    r = verify(a, variant("extra", lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone())))
    assert not r.ok and r.missing_in_a == ["lm_head.weight"]
    cfgd = tmp_path / "cfg"
    shutil.copytree(a, cfgd)
    c = json.loads((cfgd / "config.json").read_text())
    c["num_key_value_heads"] = 4
    (cfgd / "config.json").write_text(json.dumps(c))
    r = verify(a, cfgd)
    assert not r.ok and r.config_mismatch == {"num_key_value_heads": [2, 4]}
    # CLI: table and exit codes
    p = subprocess.run([sys.executable, "-m", "shardmerge", "verify", str(a), str(tmp_path / "changed")], capture_output=True, text=True, env=env())
    assert p.returncode == 3 and "values differ" in p.stdout and "DIFFERENT" in p.stdout
    p = subprocess.run([sys.executable, "-m", "shardmerge", "verify", str(a), str(a), "--json"], capture_output=True, text=True, env=env())
    assert p.returncode == 0 and json.loads(p.stdout)["ok"] is True


def test_verify_dtype_aware(verl_ckpts, tmp_path):
    for dtype in ("bfloat16", "float16", "float32"):
        shardmerge.merge(verl_ckpts / "verl_fsdp2_w2", tmp_path / dtype, dtype=dtype, quiet=True)
    for low in ("bfloat16", "float16"):  # float16 casts reach the subnormal range of the tiny weights
        r = verify(tmp_path / low, tmp_path / "float32")
        assert r.ok and r.dtype_differs and "within one ulp" in r.notes[0], r.to_dict()
    # a real difference of a few ulps is still caught
    d = tmp_path / "bumped"
    shutil.copytree(tmp_path / "float16", d)
    t = load_file(str(d / "model.safetensors"))
    w = t["model.norm.weight"].clone()
    w[0] = w[0] * 1.01
    t["model.norm.weight"] = w
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    r = verify(d, tmp_path / "float32")
    assert not r.ok and r.value_mismatch == ["model.norm.weight"]


def test_test_command_against_verl_output(verl_ckpts, tmp_path):
    job = "verl_fsdp2_w2"
    rep = merge_and_compare(verl_ckpts / job / "global_step_2" / "actor", verl_ckpts / f"{job}.verl")
    assert rep.ok, rep.to_dict()
    p = subprocess.run([sys.executable, "-m", "shardmerge", "test", "--backend", "fsdp", "--local_dir",
                        str(verl_ckpts / job / "global_step_2" / "actor"), "--test_hf_dir", str(verl_ckpts / f"{job}.verl")],
                       capture_output=True, text=True, env=env())
    assert p.returncode == 0 and "SAME" in p.stdout
    # A reference holding other weights fails the test with exit code 3.
    other = tmp_path / "other"
    shutil.copytree(verl_ckpts / f"{job}.verl", other)
    t = load_file(str(other / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"] * 2
    save_file(t, str(other / "model.safetensors"), metadata={"format": "pt"})
    p = subprocess.run([sys.executable, "-m", "shardmerge", "test", "--local_dir", str(verl_ckpts / job / "global_step_2" / "actor"),
                        "--test_hf_dir", str(other)], capture_output=True, text=True, env=env())
    assert p.returncode == 3 and "model.norm.weight" in p.stdout


# -- hub upload ----------------------------------------------------------------------------------------------------------


def test_hub_upload_call_path(fsdp_ckpts, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, **kw):
            calls.append(("create_repo", kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))
            assert (Path(kw["folder_path"]) / "shardmerge.json").exists()  # uploaded only once complete
            return type("Info", (), {"commit_url": "https://hub.invalid/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "out"
    shardmerge.merge(fsdp_ckpts / "fsdp2_w2_llama" / "actor", out, quiet=True, upload_repo="me/tiny", private=True)
    assert calls[0] == ("create_repo", {"repo_id": "me/tiny", "private": True, "repo_type": "model", "exist_ok": True})
    assert calls[1][0] == "upload_folder" and calls[1][1]["folder_path"] == str(out) and calls[1][1]["repo_id"] == "me/tiny"


def test_hub_upload_failure_keeps_output(fsdp_ckpts, tmp_path, monkeypatch):
    import huggingface_hub

    class Offline:
        def create_repo(self, **kw):
            raise ConnectionError("Failed to resolve 'huggingface.co'\nretrying...")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    out = tmp_path / "out"
    with pytest.raises(shardmerge.UploadError, match="upload of .* to me/tiny failed: ConnectionError: Failed to resolve") as e:
        shardmerge.merge(fsdp_ckpts / "fsdp2_w2_llama" / "actor", out, quiet=True, upload_repo="me/tiny")
    assert "\n" not in str(e.value) and "local output is kept" in str(e.value)
    assert (out / "shardmerge.json").exists()
