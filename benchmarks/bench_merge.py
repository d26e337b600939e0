"""Merge throughput and peak memory, beside a raw copy of the same bytes (and other mergers when installed).

Cases:
  small  Qwen2.5-0.5B-shaped fp32 checkpoint, FSDP2 world size 2, written by torch's FSDP2 on 2 gloo processes
         (verl actor layout), or its DCP form (``--form dcp``: ``torch.distributed.checkpoint.save``).
  7b     Qwen2.5-7B-shaped fp32 checkpoint (about 29 GB), world size 8, written one rank at a time as DTensors
         (no model in memory; shapes from the HF model on the meta device).

Each run is a fresh ``shardmerge merge`` process; wall time and peak RSS come from ``os.wait4`` of that process.
Checkpoints are cached under ``--work`` (default /tmp/shardmerge-bench). Figures are printed, not judged.

    python benchmarks/bench_merge.py --case small
    python benchmarks/bench_merge.py --case small --form dcp --others
    python benchmarks/bench_merge.py --case 7b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768)
QWEN7 = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
             num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=32768)


def _config(kw):
    from transformers import Qwen2Config

    cfg = Qwen2Config(**kw)
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def _fsdp2_worker(rank: int, world: int, port: int, out: str, form: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(_config(QWEN05))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02, generator=g)
    sd = model.state_dict()
    actor = Path(out)
    if form == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": sd}, checkpoint_id=str(actor))
    else:
        torch.save(sd, actor / f"model_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def write_small(folder: Path, form: str) -> None:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ckpt_writers import free_port

    folder.mkdir(parents=True, exist_ok=True)
    mp.spawn(_fsdp2_worker, args=(2, free_port(), str(folder), form), nprocs=2, join=True)
    _config(QWEN05).save_pretrained(str(folder / "huggingface"))
    if form != "dcp":
        (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))


def write_7b(folder: Path, world: int = 8) -> None:
    """Write rank files one at a time: DTensor shards with Shard(0) on a 1-D mesh, as FSDP2 saves them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from transformers import Qwen2ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ckpt_writers import free_port

    folder.mkdir(parents=True, exist_ok=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(_config(QWEN7))
    shapes = {k: (tuple(v.shape), v.stride()) for k, v in model.state_dict().items()}
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("fsdp",), _init_backend=False)
    for r in range(world):
        mesh._coordinate_on_dim = [r]
        g = torch.Generator().manual_seed(r)
        sd = {}
        for k, (shape, stride) in shapes.items():
            n = shape[0]
            chunk = -(-n // world)
            rows = max(0, min(n, (r + 1) * chunk) - r * chunk)
            local = torch.empty((rows,) + shape[1:], dtype=torch.float32).normal_(0, 0.02, generator=g)
            spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size(shape), stride, torch.float32))
            sd[k] = DTensor(local, spec, requires_grad=False)
        torch.save(sd, folder / f"model_world_size_{world}_rank_{r}.pt")
        del sd
        print(f"  wrote rank {r + 1}/{world}", flush=True)
    dist.destroy_process_group()
    _config(QWEN7).save_pretrained(str(folder / "huggingface"))
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))


def settle() -> None:
    # The previous run's output was just deleted; on filesystems mounted with `discard` (this one) the freed blocks
    # are trimmed in the background and slow the next writes. Let that finish before timing anything.
    os.sync()
    time.sleep(2)


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, int, int]:
    """``(seconds, peak RSS bytes, exit code)`` of one process."""
    settle()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        err = p.stderr.read().decode()[-2000:]
        print(f"    command failed ({rc}): {' '.join(cmd)}\n{err}")
    return dt, usage.ru_maxrss * 1024, rc


def source_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and (p.suffix in (".pt", ".distcp")))


def row(name: str, seconds: float, rss: int, nbytes: int) -> None:
    print(f"  {name:<52} {seconds:8.2f} s   peak RSS {rss / 2**20:8.0f} MiB   {nbytes / 2**20 / seconds:8.0f} MiB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("small", "7b"), default="small")
    ap.add_argument("--form", choices=("fsdp", "dcp"), default="fsdp")
    ap.add_argument("--work", default="/tmp/shardmerge-bench")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--others", action="store_true", help="also run verl / accelerate / dcp_to_torch_save when installed")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    work = Path(args.work)
    src = work / f"{args.case}-{args.form}"
    if not src.exists() or not any(src.iterdir()):
        print(f"writing the {args.case} checkpoint ({args.form}) to {src} ...", flush=True)
        t0 = time.perf_counter()
        tmp = src.with_name(src.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if args.case == "small":
            write_small(tmp, args.form)
        else:
            write_7b(tmp)
        tmp.rename(src)
        print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)
    nbytes = source_bytes(src)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    print(f"case {args.case} ({args.form}): {nbytes / 1e9:.2f} GB of rank files in {src}; {os.cpu_count()} CPUs")

    out = work / "out"
    for i in range(args.repeat):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        settle()
        t0 = time.perf_counter()
        for p in src.iterdir():
            if p.is_file():
                shutil.copyfile(p, out / p.name)
        row(f"raw copy of the same bytes (#{i + 1})", time.perf_counter() - t0, 0, nbytes)
    shutil.rmtree(out, ignore_errors=True)  # free the space before the merges (their disk check counts it)
    # A fresh expected-key-set cache: the first run is a first merge of this config (the model check runs in a
    # helper process), the following ones find the cache (as every later checkpoint of a training run does).
    import tempfile

    env["SHARDMERGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardmerge-bench-cache-")
    for i in range(args.repeat + 1):
        target = work / "merged"
        shutil.rmtree(target, ignore_errors=True)
        dt, rss, rc = measure([sys.executable, "-m", "shardmerge", "merge", str(src), "--target-dir", str(target),
                               "--dtype", args.dtype, "--quiet"], env)
        if rc == 0:
            label = "first merge of this config" if i == 0 else f"config seen before, #{i}"
            row(f"shardmerge --dtype {args.dtype} ({label})", dt, rss, nbytes)
    if args.others:
        _others(args, src, work, env, nbytes)
    shutil.rmtree(out, ignore_errors=True)


def _others(args, src: Path, work: Path, env: dict, nbytes: int) -> None:
    import importlib.util

    target = work / "other"
    if importlib.util.find_spec("ray") is None:  # verl imports ray at package import; the tests' stand-in does
        stubs = str(Path(__file__).resolve().parents[1] / "tests" / "stubs")
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [stubs, env.get("PYTHONPATH")]))}
    if args.form == "fsdp" and importlib.util.find_spec("verl") is not None:
        shutil.rmtree(target, ignore_errors=True)
        dt, rss, rc = measure([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                               "--local_dir", str(src), "--target_dir", str(target)], env)
        if rc == 0:
            row("verl.model_merger merge", dt, rss, nbytes)
    if args.form == "dcp":
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        code = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
                "f(sys.argv[1], sys.argv[2])")
        dt, rss, rc = measure([sys.executable, "-c", code, str(src), str(target / "full.pt")], env)
        if rc == 0:
            row("dcp_to_torch_save", dt, rss, nbytes)
        if importlib.util.find_spec("accelerate") is not None:
            shutil.rmtree(target, ignore_errors=True)
            dt, rss, rc = measure(["accelerate", "merge-weights", str(src), str(target)], env)
            if rc == 0:
                row("accelerate merge-weights", dt, rss, nbytes)
    shutil.rmtree(target, ignore_errors=True)


if __name__ == "__main__":
    main()
