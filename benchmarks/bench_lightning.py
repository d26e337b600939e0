"""Training-step overhead of MergeOnSave: Lightning on CPU, with and without the callback.

Runs the same training twice in fresh processes (ModelParallelStrategy, 2 processes, a ~50 MB fp32 model,
checkpoints every ``--every`` steps) and prints the median step time, the median save-call time (trainer.save_checkpoint
as ModelCheckpoint calls it) and, with MergeOnSave, the merge latency (checkpoint complete -> HF directory complete).

    python benchmarks/bench_lightning.py [--steps 40] [--every 10]

On a 2-core machine the worker competes with the two training processes for the same cores; the step-time figure
is reported, not judged. Figures come from timestamps each process writes to ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def train(out: Path, steps: int, every: int, merge: bool) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from transformers import Qwen2Config, Qwen2ForCausalLM

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            cfg = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
            self.model = Qwen2ForCausalLM(cfg)

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, _):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(L.Callback):
        def __init__(self):
            self.steps, self.saves, self.done = [], [], {}

        def setup(self, trainer, pl_module, stage):
            orig = trainer.save_checkpoint

            def timed(filepath, weights_only=False, storage_options=None):
                t0 = time.perf_counter()
                orig(filepath, weights_only=weights_only, storage_options=storage_options)
                self.saves.append(time.perf_counter() - t0)
                self.done[str(filepath)] = time.time()

            trainer.save_checkpoint = timed  # outermost wrapper: includes MergeOnSave's submit

        def on_train_batch_start(self, *a):
            self._t = time.perf_counter()

        def on_train_batch_end(self, *a):
            self.steps.append(time.perf_counter() - self._t)

        def on_train_end(self, trainer, pl_module):
            if trainer.global_rank == 0:
                (out / "timings.json").write_text(json.dumps({"steps": self.steps, "saves": self.saves, "done": self.done}))

    callbacks = [ModelCheckpoint(dirpath=str(out / "ckpts"), every_n_train_steps=every, save_top_k=-1)]
    if merge:
        from shardmerge.hooks.lightning import MergeOnSave

        callbacks.append(MergeOnSave(wait_on_exit=True))
    # setup() runs in list order, so the Timer's wrapper of save_checkpoint is the outermost one.
    callbacks.append(Timer())
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 8192, (4 * steps, 128)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(out), callbacks=callbacks)
    trainer.fit(LM(), torch.utils.data.DataLoader(data, batch_size=2))


def summarize(out: Path, merge: bool) -> dict:
    t = json.loads((out / "timings.json").read_text())
    steps = t["steps"][2:]  # first steps include warm-up
    res = {"median step s": statistics.median(steps), "median save s": statistics.median(t["saves"])}
    if merge:
        lat = []
        for ckpt, done in t["done"].items():
            st = json.loads((Path(ckpt).parent / f"{Path(ckpt).name[:-5]}_hf.status.json").read_text())
            if st["state"] == "done":
                lat.append(st["finished"] - done)
        res["merge latency s (median)"] = statistics.median(lat) if lat else float("nan")
        res["merges"] = len(lat)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--work", default="/tmp/shardmerge-bench-lightning")
    ap.add_argument("--_child", choices=("with", "without"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    if args._child:
        train(work / args._child, args.steps, args.every, args._child == "with")
        return
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    rows = {}
    for mode in ("without", "with"):
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--every", str(args.every), "--work", str(work), "--_child", mode]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows[mode] = summarize(work / mode, mode == "with")
    base, withm = rows["without"], rows["with"]
    print(f"Lightning ModelParallelStrategy, 2 CPU processes, {args.steps} steps, checkpoint every {args.every}; {os.cpu_count()} CPUs")
    print(f"  median step time   without {base['median step s'] * 1000:8.1f} ms   with MergeOnSave {withm['median step s'] * 1000:8.1f} ms"
          f"   ({(withm['median step s'] / base['median step s'] - 1) * 100:+.1f}%)")
    print(f"  median save call   without {base['median save s'] * 1000:8.1f} ms   with MergeOnSave {withm['median save s'] * 1000:8.1f} ms")
    print(f"  merge latency      median {withm['merge latency s (median)']:.2f} s over {withm['merges']} checkpoints (complete -> HF directory published)")


if __name__ == "__main__":
    main()
