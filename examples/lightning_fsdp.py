"""Lightning + FSDP2 (ModelParallelStrategy) on 2 CPU processes, with every checkpoint merged in the background.

    python examples/lightning_fsdp.py [--out DIR]

Keeps your ModelCheckpoint; adds MergeOnSave. Each `epoch=E-step=S.ckpt/` (a torch.distributed.checkpoint folder)
gets an `epoch=E-step=S_hf/` sibling that `AutoModelForCausalLM.from_pretrained` loads. The HF config comes from the
PreTrainedModel inside the LightningModule, since Lightning checkpoints carry none.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from shardmerge.hooks.lightning import MergeOnSave  # noqa: E402


class TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
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
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("SHARDMERGE_EXAMPLE_OUT") or tempfile.mkdtemp(prefix="shardmerge-lightning-"))
    args = ap.parse_args()
    os.environ["SHARDMERGE_EXAMPLE_OUT"] = args.out  # child processes re-run this script: same folder
    out = Path(args.out)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 128, (64, 16)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
        callbacks=[ModelCheckpoint(dirpath=str(out / "ckpts"), every_n_train_steps=3, save_top_k=-1),
                   MergeOnSave(dtype="bfloat16")],
    )
    trainer.fit(TinyLM(), torch.utils.data.DataLoader(data, batch_size=4))
    if trainer.global_rank == 0:
        for status in sorted((out / "ckpts").glob("*_hf.status.json")):
            st = json.loads(status.read_text())
            print(f"{st['state']:>6}  {st['target']}  ({st.get('seconds')} s)" + (f"  {st['error']}" if st.get("error") else ""))


if __name__ == "__main__":
    main()
