"""Real Lightning checkpoints written by ``lightning.Trainer`` on CPU (run as a standalone script).

Multi-process Lightning re-runs ``sys.argv`` in its child processes, so tests run this file in a subprocess:

    python tests/lightning_writers.py OUT MODE [--steps N] [--every K] [--top-k K] [--merge-on-save JSON]

MODE:
  mp      ModelParallelStrategy(data_parallel_size=2) with ``fully_shard`` in ``configure_model``: DCP folders
          ``epoch=E-step=S.ckpt/`` (model keys ``state_dict.model.``)
  fsdp    FSDPStrategy on CPU (``device_id=cpu``), 2 processes: DCP folders, model keys ``model.model.``
  single  one CPU device, ``save_hyperparameters`` of an OmegaConf config: single-file ``.ckpt``

The trained weights (gathered by torch) of every saved step are written to ``OUT/reference-step=S.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

import ckpt_writers  # noqa: E402


def build_module(family: str, mode: str, hparams=None):
    import lightning as L

    class TinyLM(L.LightningModule):
        def __init__(self, cfg=None):
            super().__init__()
            if cfg is not None:
                self.save_hyperparameters({"cfg": cfg})
            torch.manual_seed(0)
            self.model = ckpt_writers.make_model(family, seed=0)

        def configure_model(self):
            if mode != "mp":
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, _):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_save_checkpoint(self, checkpoint):
            # Record the trained weights (torch's own gather) for the tests to compare with.
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            if mode == "single":
                full = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            elif mode == "fsdp":
                # FSDP1 wraps the whole LightningModule: gather from the wrapper, then drop the attribute prefix.
                root = self.trainer.strategy.model
                full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True))
                full = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
            else:
                full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            if self.global_rank == 0:
                torch.save({k: v.clone() for k, v in full.items()}, Path(OUT) / f"reference-step={self.global_step}.pt")

    return TinyLM(hparams)


class CPUFSDPStrategy:
    """FSDPStrategy refuses CPU; building FullyShardedDataParallel with device_id=cpu works (FIXTURES)."""

    @staticmethod
    def make():
        from lightning.pytorch.strategies import FSDPStrategy

        class _S(FSDPStrategy):
            def _setup_model(self, model):
                from torch.distributed.fsdp import FullyShardedDataParallel

                return FullyShardedDataParallel(model, device_id=torch.device("cpu"), **self.kwargs)

        return _S(state_dict_type="sharded", process_group_backend="gloo")


OUT = ""


def _corrupter_base():
    import lightning as L

    return L.Callback


class Corrupter(_corrupter_base()):
    """Truncates one file of the checkpoint saved at ``step``, after the save and before MergeOnSave sees it
    (listed before MergeOnSave, so its wrapper of ``save_checkpoint`` is the inner one)."""

    def __init__(self, step: int):
        self.step = step

    def setup(self, trainer, pl_module, stage):
        orig = trainer.save_checkpoint

        def save_checkpoint(filepath, weights_only=False, storage_options=None):
            orig(filepath, weights_only=weights_only, storage_options=storage_options)
            if trainer.global_rank == 0 and trainer.global_step == self.step:
                p = Path(filepath)
                victim = sorted(p.glob("__1_*.distcp"))[0] if p.is_dir() else p
                data = victim.read_bytes()
                victim.write_bytes(data[: len(data) // 3])

        trainer.save_checkpoint = save_checkpoint


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("mode", choices=("mp", "fsdp", "single"))
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--merge-on-save", default=None, help="JSON of MergeOnSave options (adds the callback)")
    ap.add_argument("--no-logger", action="store_true")
    ap.add_argument("--corrupt-step", type=int, default=None, help="damage the checkpoint of this step right after it is saved")
    args = ap.parse_args()
    OUT = args.out
    Path(OUT).mkdir(parents=True, exist_ok=True)

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 90, (64, 12), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    hparams = None
    if args.mode == "single":
        from omegaconf import OmegaConf

        hparams = OmegaConf.create({"lr": 0.01, "model": {"family": args.family, "layers": 2}})
    module = build_module(args.family, args.mode, hparams)
    callbacks = [ModelCheckpoint(dirpath=str(Path(OUT) / "ckpts"), every_n_train_steps=args.every, save_top_k=args.top_k,
                                 monitor="step" if args.top_k > 0 else None, mode="max", save_last=False)]
    if args.corrupt_step is not None:
        callbacks.append(Corrupter(args.corrupt_step))
    if args.merge_on_save is not None:
        from shardmerge.hooks.lightning import MergeOnSave

        callbacks.append(MergeOnSave(**json.loads(args.merge_on_save)))
    if args.mode == "mp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, devices = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2
    elif args.mode == "fsdp":
        strategy, devices = CPUFSDPStrategy.make(), 2
    else:
        strategy, devices = "auto", 1
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.steps, callbacks=callbacks,
                        logger=False if args.no_logger else None, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=OUT)
    trainer.fit(module, loader)


if __name__ == "__main__":
    main()
