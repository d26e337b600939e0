"""Drive verl's own PPO save path with merge_on_save, in a fresh process (as verl's TaskRunner would).

    python tests/verl_hook_driver.py ROOT FLAG STEPS            (tests/stubs on PYTHONPATH unless ray is installed)

``import verl`` loads the ``verl.plugins`` entry points (shardmerge's hook among them). A ``RayPPOTrainer`` is built
without Ray: its worker groups are replaced by objects whose ``save_checkpoint`` calls verl's real
``FSDPCheckpointManager`` on an FSDP2 actor and critic in a one-process gloo group. Then verl's real
``RayPPOTrainer._save_checkpoint`` runs for each step (one optimizer step between saves), and
``ROOT/reference-<role>-step<N>.pt`` records each saved model's weights. FLAG is ``true``/``false`` (or ``unset``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    root, flag, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    import torch
    import torch.distributed as dist

    import ckpt_writers
    import verl  # noqa: F401 - loads the verl.plugins entry points
    from omegaconf import OmegaConf
    from transformers import PreTrainedTokenizerFast, Qwen2ForTokenClassification
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    print(json.dumps({"patched": bool(getattr(RayPPOTrainer._save_checkpoint, "_shardmerge", False))}), flush=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ckpt_writers.free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)

    ckpt_writers.write_tokenizer(root / "tok")
    tok = PreTrainedTokenizerFast.from_pretrained(str(root / "tok"))
    actor = ckpt_writers._parallelize(ckpt_writers.make_model("qwen2"), "fsdp2", 1)
    ccfg = ckpt_writers.make_config("qwen2", num_labels=1)
    ccfg.architectures = ["Qwen2ForTokenClassification"]
    torch.manual_seed(1)
    critic = ckpt_writers._parallelize(Qwen2ForTokenClassification(ccfg), "fsdp2", 1)
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (actor, critic)}
    contents = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"], "load_contents": ["model"]})

    class WorkerGroup:
        """Stands in for the Ray worker group: the same save_checkpoint call, run here on the one rank."""

        def __init__(self, model, role):
            self.model, self.role = model, role
            self.mgr = FSDPCheckpointManager(model=model, optimizer=opts[model], processing_class=tok, checkpoint_config=contents)

        def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
            self.mgr.save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep=max_ckpt_to_keep)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            torch.save({k: v.clone() for k, v in full.items()}, root / f"reference-{self.role}-step{global_step}.pt")

    class Loader:
        def state_dict(self):
            return {"epoch": 0}

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    tcfg = {"default_local_dir": str(root / "ckpts"), "default_hdfs_dir": None, "max_actor_ckpt_to_keep": None,
            "max_critic_ckpt_to_keep": None}
    if flag != "unset":
        tcfg["merge_on_save"] = flag == "true"
        tcfg["shardmerge"] = {"dtype": "float32"}
    trainer.config = OmegaConf.create({"trainer": tcfg, "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}}})
    trainer.use_critic = True
    trainer.actor_rollout_wg = WorkerGroup(actor, "actor")
    trainer.critic_wg = WorkerGroup(critic, "critic")
    trainer.train_dataloader = Loader()
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        for m in (actor, critic):
            ids = torch.randint(0, 90, (2, 10), generator=g)
            m(input_ids=ids).logits.float().pow(2).mean().backward()
            opts[m].step()
            opts[m].zero_grad()
        trainer.global_steps = step
        trainer._save_checkpoint()
    from shardmerge.hooks import verl as hook

    statuses = hook.finish(trainer)
    print(json.dumps({"statuses": statuses}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
