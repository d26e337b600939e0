"""Genuine verl checkpoints: verl 0.9.1's own ``FSDPCheckpointManager.save_checkpoint`` on CPU/gloo.

    python tests/verl_writers.py OUT JOB [JOB ...]      (needs tests/stubs on PYTHONPATH unless ray is installed)

Jobs (world size in the name) train a tiny model for two steps, then let verl save it into
``OUT/<job>/global_step_2/<role>/`` exactly as its trainer does (rank files, optimizer and extra state,
``fsdp_config.json``, ``huggingface/`` with config and tokenizer), write ``latest_checkpointed_iteration.txt`` and
``OUT/<job>/reference.pt`` (the full state dict gathered by torch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

import ckpt_writers  # noqa: E402

# job -> (family, layout, world size, role)
JOBS = {
    "verl_fsdp2_w2": ("qwen2", "fsdp2", 2, "actor"),
    "verl_fsdp1_w2": ("llama", "fsdp1", 2, "actor"),
    "verl_hsdp_w4": ("llama", "hsdp", 4, "actor"),
    "verl_critic_w2": ("qwen2", "critic", 2, "critic"),
}


def _model(family: str, layout: str):
    import transformers

    if layout == "critic":
        cfg = ckpt_writers.make_config(family, num_labels=1)
        cls = getattr(transformers, ckpt_writers.FAMILIES[family]["cls"].replace("ForCausalLM", "ForTokenClassification"))
        cfg.architectures = [cls.__name__]
        torch.manual_seed(0)
        return cls(cfg)
    return ckpt_writers.make_model(family, seed=0)


def _worker(rank: int, world: int, port: int, out: str, jobs: list[str]) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from transformers import PreTrainedTokenizerFast

    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for job in jobs:
            family, layout, w, role = JOBS[job]
            assert w == world
            model = _model(family, layout)
            model = ckpt_writers._parallelize(model, "fsdp2" if layout == "critic" else layout, world)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(1)
            for _ in range(2):
                ids = torch.randint(0, 90, (2, 12), generator=g)
                out_ = model(input_ids=ids)
                loss = out_.logits.float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            full = ckpt_writers._full_state_dict(model, layout)
            folder = Path(out) / job
            tok_dir = folder / "tokenizer"
            if rank == 0:
                ckpt_writers.write_tokenizer(tok_dir)
            dist.barrier()
            tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
            mgr = FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=None, processing_class=tok,
                                        checkpoint_config=OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                                                            "load_contents": ["model", "optimizer", "extra"]}))
            mgr.save_checkpoint(str(folder / "global_step_2" / role), global_step=2)
            dist.barrier()
            if rank == 0:
                torch.save({k: v.clone() for k, v in full.items()}, folder / "reference.pt")
                (folder / "latest_checkpointed_iteration.txt").write_text("2")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    out, jobs = Path(argv[0]), argv[1:]
    out.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, list[str]] = {}
    for j in jobs:
        by_world.setdefault(JOBS[j][2], []).append(j)
    for world, js in sorted(by_world.items()):
        mp.spawn(_worker, args=(world, ckpt_writers.free_port(), str(out), js), nprocs=world, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
