"""Save-time merging: the background worker (order, supersede, pins, failures, keep_last, wait_on_exit) and the
Lightning MergeOnSave callback in real Lightning runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from shardmerge.background import MergeWorker, read_status, status_path
from shardmerge.hfdir import read_manifest

HERE = Path(__file__).parent


def steps_of(fsdp_ckpts: Path, tmp_path: Path, n: int, job: str = "fsdp2_w2_llama") -> list[Path]:
    """n checkpoints of one run: run/global_step_{10,20,...}/actor (copies of one real FSDP2 checkpoint)."""
    out = []
    for i in range(1, n + 1):
        d = tmp_path / "run" / f"global_step_{i * 10}" / "actor"
        shutil.copytree(fsdp_ckpts / job / "actor", d)
        out.append(d)
    return out


def assert_merged(target: Path, reference: Path, dtype=torch.bfloat16) -> None:
    ref = torch.load(reference)
    got = load_file(str(target / "model.safetensors"))
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v.to(dtype)), k


def test_jobs_run_in_order_with_pins_and_status(fsdp_ckpts, tmp_path):
    srcs = steps_of(fsdp_ckpts, tmp_path, 3)
    w = MergeWorker()
    jobs = [w.submit(s) for s in srcs]
    assert all(j is not None for j in jobs)
    # Rotation right after submit: the pin keeps the files the merge reads.
    shutil.rmtree(srcs[0])
    sts = w.close(wait=True, timeout=300)
    assert [s["state"] for s in sts] == ["done", "done", "done"], sts
    starts = [s["started"] for s in sts]
    assert starts == sorted(starts)
    for s, src in zip(sts, srcs):
        target = Path(s["target"])
        assert target == src.parent / "actor_hf"
        assert_merged(target, fsdp_ckpts / "fsdp2_w2_llama" / "reference.pt")
        m = read_manifest(target)
        assert m["source"] == str(src) and m["run"] == str(src.parent) and m["step"] == int(src.parent.name.split("_")[-1])
        assert s["error"] is None and s["seconds"] > 0 and "pinned" in s["pin"]
        assert not (src.parent / ".shardmerge-pins").exists()


def test_supersede_drops_queued_jobs(fsdp_ckpts, tmp_path):
    srcs = steps_of(fsdp_ckpts, tmp_path, 3)
    w = MergeWorker()
    for s in srcs:
        w.submit(s, run="r", supersede=True)
    sts = w.close(wait=True, timeout=300)
    states = [s["state"] for s in sts]
    assert states[-1] == "done" and "superseded" in states, states
    for s in sts:
        if s["state"] == "superseded":
            assert "superseded by the newer checkpoint" in s["error"]
            assert not Path(s["target"]).exists()
    # Without supersede every checkpoint is merged.
    srcs2 = steps_of(fsdp_ckpts, tmp_path / "b", 3)
    w2 = MergeWorker()
    for s in srcs2:
        w2.submit(s, run="r")
    assert [s["state"] for s in w2.close(wait=True, timeout=300)] == ["done"] * 3


def test_failed_merge_is_recorded_not_raised(fsdp_ckpts, tmp_path):
    [src] = steps_of(fsdp_ckpts, tmp_path, 1)
    p = src / "model_world_size_2_rank_1.pt"
    p.write_bytes(p.read_bytes()[:1000])
    w = MergeWorker()
    assert w.submit(src) is not None
    [st] = w.close(wait=True, timeout=300)
    assert st["state"] == "failed" and "model_world_size_2_rank_1.pt" in st["error"] and "\n" not in st["error"]
    assert not (src.parent / "actor_hf").exists()
    assert not [x for x in src.parent.iterdir() if ".partial-" in x.name] and not (src.parent / ".shardmerge-pins").exists()


def test_unpinnable_source_removed_fails_cleanly(fsdp_ckpts, tmp_path, monkeypatch):
    srcs = steps_of(fsdp_ckpts, tmp_path, 2)

    def no_links(*a, **k):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    w = MergeWorker()
    w.submit(srcs[0])
    w.submit(srcs[1])
    shutil.rmtree(srcs[1])  # rotation before the worker reached it
    sts = w.close(wait=True, timeout=300)
    assert sts[0]["state"] == "done" and "not pinned" in sts[0]["pin"]
    assert sts[1]["state"] == "failed" and "removed" in sts[1]["error"]


def test_keep_last_deletes_only_our_older_merges(fsdp_ckpts, tmp_path):
    srcs = steps_of(fsdp_ckpts, tmp_path, 4)
    run_root = srcs[0].parent.parent
    foreign = srcs[0].parent / "notes_hf"
    foreign.mkdir()
    (foreign / "x.txt").write_text("keep me")
    import shardmerge

    offline = srcs[1].parent / "offline_hf"
    shardmerge.merge(srcs[1], offline, quiet=True)  # manifest without a run: never deleted
    w = MergeWorker()
    for s in srcs:
        w.submit(s, run=str(run_root), keep_last=2)
    sts = w.close(wait=True, timeout=300)
    assert [s["state"] for s in sts] == ["removed", "removed", "done", "done"]
    assert not (srcs[0].parent / "actor_hf").exists() and not (srcs[1].parent / "actor_hf").exists()
    assert (srcs[2].parent / "actor_hf").exists() and (srcs[3].parent / "actor_hf").exists()
    assert (foreign / "x.txt").exists() and (offline / "shardmerge.json").exists()


def test_wait_on_exit_false_returns_at_once(fsdp_ckpts, tmp_path):
    srcs = steps_of(fsdp_ckpts, tmp_path, 2)
    w = MergeWorker()
    for s in srcs:
        w.submit(s)
    t0 = time.time()
    sts = w.close(wait=False)
    assert time.time() - t0 < 1.0
    assert any(s["state"] in ("queued", "running") for s in sts)
    deadline = time.time() + 300
    while time.time() < deadline and any((read_status(s.parent / "actor_hf") or {}).get("state") != "done" for s in srcs):
        time.sleep(0.2)
    assert all(read_status(s.parent / "actor_hf")["state"] == "done" for s in srcs)


def test_worker_inherits_no_distributed_environment(fsdp_ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    [src] = steps_of(fsdp_ckpts, tmp_path, 1)
    w = MergeWorker()
    w.submit(src)
    env = Path(f"/proc/{w.proc.pid}/environ").read_bytes().split(b"\0")
    names = {e.split(b"=", 1)[0].decode() for e in env if e}
    assert not names & {"RANK", "WORLD_SIZE", "MASTER_ADDR"}
    assert os.getsid(w.proc.pid) != os.getsid(0)  # its own session: survives the trainer with wait_on_exit=False
    assert w.close(wait=True, timeout=300)[0]["state"] == "done"


def test_bad_submissions_never_raise(tmp_path):
    w = MergeWorker()
    assert w.submit(tmp_path / "does-not-exist") is None
    st = read_status(tmp_path / "does-not-exist_hf")
    assert st["state"] == "failed" and "does not exist" in st["error"] and st["error"].startswith("not queued")
    assert w.proc is None  # nothing was started for it
    # An invalid option is refused at submit time, recorded, and still does not raise.
    w2 = MergeWorker()
    assert w2.submit(tmp_path / "x", target=tmp_path / "x_hf", dtype="int8") is None
    assert read_status(tmp_path / "x_hf")["state"] == "failed"


# -- Lightning -----------------------------------------------------------------------------------------------------


def run_lightning(out: Path, mode: str, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    p = subprocess.run([sys.executable, str(HERE / "lightning_writers.py"), str(out), mode, *extra],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert p.returncode == 0, f"training failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def test_lightning_model_parallel_every_kept_checkpoint_merged(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "mp"
    run_lightning(out, "mp", "--steps", "6", "--every", "2", "--top-k", "2", "--merge-on-save", json.dumps({"dtype": "float32"}))
    ckpts = out / "ckpts"
    kept = sorted(p for p in ckpts.glob("*.ckpt"))
    assert [p.name for p in kept] == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]  # top-2 rotation removed step 2
    for step in (2, 4, 6):
        target = ckpts / f"epoch=0-step={step}_hf"
        st = json.loads(status_path(target).read_text())
        assert st["state"] == "done", st  # step 2 was rotated away while queued: its pin kept it readable
        ref = {k: v for k, v in torch.load(out / f"reference-step={step}.pt").items() if k != "lm_head.weight"}
        got = load_file(str(target / "model.safetensors"))
        assert set(got) == set(ref) and all(torch.equal(got[k], v) for k, v in ref.items())
        assert json.loads((target / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    AutoModelForCausalLM.from_pretrained(str(ckpts / "epoch=0-step=6_hf"))
    assert not (ckpts / ".shardmerge-pins").exists()
    # The trainer's logger (Lightning's default CSVLogger here) received each merge's seconds and bytes.
    import csv

    rows = list(csv.DictReader(open(next(out.glob("lightning_logs/version_*/metrics.csv")))))
    merged = {int(r["step"]): float(r["shardmerge/bytes"]) for r in rows if r.get("shardmerge/bytes")}
    assert sorted(merged) == [2, 4, 6] and all(b > 0 for b in merged.values())
    assert not [p for p in ckpts.iterdir() if ".partial-" in p.name]


def test_lightning_single_device_no_logger_no_wait(tmp_path):
    out = tmp_path / "single"
    run_lightning(out, "single", "--steps", "4", "--every", "2", "--no-logger",
                  "--merge-on-save", json.dumps({"wait_on_exit": False}))
    ckpts = out / "ckpts"
    deadline = time.time() + 300
    targets = [ckpts / f"epoch=0-step={s}_hf" for s in (2, 4)]
    while time.time() < deadline and not all((read_status(t) or {}).get("state") in ("done", "failed") for t in targets):
        time.sleep(0.3)
    for s, t in zip((2, 4), targets):
        assert read_status(t)["state"] == "done", read_status(t)
        ref = {k: v for k, v in torch.load(out / f"reference-step={s}.pt").items() if k != "lm_head.weight"}
        got = load_file(str(t / "model.safetensors"))
        assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in ref.items())
        # The HF config came from the module's PreTrainedModel, written once beside the checkpoints.
        assert (ckpts / ".shardmerge-hf" / "config.json").exists()


def test_lightning_corrupt_checkpoint_does_not_stop_training(tmp_path):
    out = tmp_path / "bad"
    run_lightning(out, "mp", "--steps", "4", "--every", "2", "--corrupt-step", "2", "--merge-on-save", "{}")
    ckpts = out / "ckpts"
    bad = read_status(ckpts / "epoch=0-step=2_hf")
    assert bad["state"] == "failed" and "__1_0.distcp" in bad["error"] and "\n" not in bad["error"]
    assert not (ckpts / "epoch=0-step=2_hf").exists()
    assert read_status(ckpts / "epoch=0-step=4_hf")["state"] == "done"  # training went on and the next one merged
    assert not [p for p in ckpts.iterdir() if ".partial-" in p.name]
