"""Check the GPU paths on a machine with CUDA: merges with ``device="cuda"`` against the CPU result.

    python benchmarks/gpu_check.py [--out DIR]

1. a real FSDP2 checkpoint (2 gloo processes) merged to bfloat16 on CPU and on CUDA: bit-identical;
2. a LoRA checkpoint (peft + FSDP2) merged on CPU and on CUDA: equal within float32 rounding, and equal to peft's
   ``merge_and_unload``;
3. the background worker with ``device="cuda"``: the job is done and its output equals the CPU merge;
4. a timing of a LoRA merge of a larger layer stack on CPU and CUDA.
Prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu runs the same script as a dry run of its logic")
    args = ap.parse_args()
    dev = args.device
    import torch
    from safetensors.torch import load_file

    import ckpt_writers
    import shardmerge
    from shardmerge.background import MergeWorker

    if dev == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here")
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="shardmerge-gpu-"))
    fx = out / "fixtures"
    t0 = time.perf_counter()
    ckpt_writers.build(fx, ["fsdp2_w2_llama", "lora_qv_w2", "lora_dora_w2"])
    print(f"fixtures written in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0) if dev == 'cuda' else 'cpu dry run'}")
    failures = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)

    def load(d: Path) -> dict:
        return load_file(str(d / "model.safetensors"))

    src = fx / "fsdp2_w2_llama" / "actor"
    shardmerge.merge(src, out / "cpu", quiet=True)
    t = time.perf_counter()
    shardmerge.merge(src, out / "cuda", quiet=True, device=dev, cuda_memory_fraction=0.1)
    a, b = load(out / "cpu"), load(out / "cuda")
    check("bf16 cast on cuda == cpu", set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), f"{len(a)} tensors, {time.perf_counter() - t:.2f} s")

    for job in ("lora_qv_w2", "lora_dora_w2"):
        lsrc = ckpt_writers.source_of(fx, job)
        shardmerge.merge(lsrc, out / f"{job}-cpu", dtype="float32", lora="merge", quiet=True)
        shardmerge.merge(lsrc, out / f"{job}-cuda", dtype="float32", lora="merge", quiet=True, device=dev)
        a, b = load(out / f"{job}-cpu"), load(out / f"{job}-cuda")
        pm = ckpt_writers.make_peft(job)
        pm.load_state_dict(torch.load(fx / job / "reference.pt"))
        want = pm.merge_and_unload().state_dict()
        diff_dev = max(float((a[k] - b[k]).abs().max()) for k in a)
        diff_peft = max(float((b[k] - want[k]).abs().max()) for k in want)
        ok = all(torch.allclose(b[k], want[k], rtol=1e-6, atol=1e-6) for k in want)
        check(f"{job} merge on cuda == peft merge_and_unload", ok, f"max |cuda-cpu| {diff_dev:.3g}, max |cuda-peft| {diff_peft:.3g}")

    w = MergeWorker(shardmerge.MergeConfig(device=dev))
    w.submit(src, target=out / "worker-cuda")
    [st] = w.close(wait=True, timeout=600)
    a, b = load(out / "cpu"), load(out / "worker-cuda") if st["state"] == "done" else {}
    check("background worker on cuda", st["state"] == "done" and all(torch.equal(a[k], b[k]) for k in a),
          f"state {st['state']} {st.get('error') or ''} {st.get('seconds')} s")

    # Timing: LoRA products for a 7B-sized layer stack (28 x 4 projections of 3584 x 3584, r=64), in memory.
    from shardmerge.convert.lora import LoraMerged, LoraModule
    from shardmerge.formats.base import InMemory, full_box

    g = torch.Generator().manual_seed(0)
    W = InMemory(torch.randn(3584, 3584, generator=g))
    m = LoraModule("x", A=InMemory(torch.randn(64, 3584, generator=g)), B=InMemory(torch.randn(3584, 64, generator=g)))
    for device in ("cpu", dev) if dev == "cuda" else ("cpu",):
        src_ = LoraMerged(W, m, 0.5, device)
        outbuf = torch.empty(3584, 3584)
        src_.read_into(full_box(W.shape), outbuf)  # warm-up
        t = time.perf_counter()
        for _ in range(28 * 4):
            LoraMerged(W, m, 0.5, device).read_into(full_box(W.shape), outbuf)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"INFO  LoRA merge of 112 layers 3584x3584 r=64 on {device}: {time.perf_counter() - t:.2f} s")
    print(f"{'ALL PASS' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
