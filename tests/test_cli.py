"""The command line: verl's spellings, --json, one-line errors with exit codes, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from conftest import leftovers

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "shardmerge", *map(str, args)], capture_output=True, text=True, env=ENV)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {p.stderr}")
    return p


def test_verl_spelling_and_json(fsdp_ckpts, tmp_path):
    src = fsdp_ckpts / "fsdp2_w2_llama" / "actor"
    out = tmp_path / "out"
    p = run("merge", "--backend", "fsdp", "--local_dir", src, "--target_dir", out, "--use_cpu_initialization", "--json")
    rep = json.loads(p.stdout)
    assert rep["format"] == "fsdp" and rep["target"] == str(out) and rep["world_size"] == 2
    ref = torch.load(fsdp_ckpts / "fsdp2_w2_llama" / "reference.pt")
    got = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in ref.items())


def test_inspect_human_and_json(fsdp_ckpts):
    src = fsdp_ckpts / "hsdp_2x2_llama" / "actor"
    p = run("inspect", src)
    assert "mesh                   (ddp=2, fsdp=2)" in p.stdout
    assert "(Replicate(), Shard(dim=0)) x21" in p.stdout
    assert "predicted peak memory" in p.stdout
    rep = json.loads(run("inspect", "--local-dir", src, "--json").stdout)
    assert rep["world_size"] == 4 and rep["planned"][0]["file"] == "model.safetensors"


def test_error_is_last_stderr_line_with_exit_code(tmp_path):
    p = run("merge", tmp_path / "missing", "--target-dir", tmp_path / "o", check=False)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("shardmerge: error: ") and "does not exist" in last
    assert "Traceback" not in p.stderr
    assert run("merge", check=False).returncode == 2  # usage
    assert run("frobnicate", check=False).returncode == 2


def test_sigterm_removes_temporary_output(fsdp_ckpts, tmp_path):
    """SIGTERM mid-write: exit 130, no target, no temporary folder."""
    src = fsdp_ckpts / "fsdp2_w2_llama" / "actor"
    out = tmp_path / "out"
    code = (
        "import time, sys, shardmerge.writer as w\n"
        "real = w._pwrite_all\n"
        "def slow(*a):\n    time.sleep(0.3); real(*a)\n"
        "w._pwrite_all = slow\n"
        "from shardmerge.cli import main\n"
        f"sys.exit(main(['merge', {str(src)!r}, '--target-dir', {str(out)!r}, '--workers', '1', '--memory-budget', '16KiB']))\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], env=ENV, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not any(".partial-" in x.name for x in tmp_path.iterdir()):
        time.sleep(0.05)
    assert any(".partial-" in x.name for x in tmp_path.iterdir()), "merge never started writing"
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted" in err.strip().splitlines()[-1]
    assert not out.exists() and leftovers(tmp_path) == []
