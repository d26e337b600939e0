"""Real sharded checkpoints written by torch's own FSDP2 / FSDP1 / DTensor code on gloo, at tiny sizes.

Run as a script (``python tests/ckpt_writers.py OUT WORLD JOB [JOB ...]``) so that the multi-process world lives in
its own interpreter; the test session calls :func:`build` once. Each job trains a tiny HF model for two optimizer
steps under its parallel layout, then writes, in verl's actor layout:

* ``OUT/<job>/actor/model_world_size_W_rank_R.pt`` (each rank's ``model.state_dict()``), ``fsdp_config.json``,
  ``huggingface/`` (config, tokenizer, generation config, chat template);
* ``OUT/<job>/reference.pt``: the full state dict gathered by torch (``get_model_state_dict`` with
  ``full_state_dict=True``): the trained model every merged tensor is compared with.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

FAMILIES = {
    # Llama with GQA (4 query heads, 2 KV heads), untied.
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", kw=dict(vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  max_position_embeddings=64)),
    # Qwen2: qkv bias, tied embeddings, vocabulary 99 (uneven over 2 and 4 ranks).
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", kw=dict(vocab_size=99, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=64)),
    # Qwen3: explicit head_dim different from hidden/heads, q/k norms.
    "qwen3": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", kw=dict(vocab_size=101, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                  max_position_embeddings=64)),
    # Qwen3-MoE: 4 experts fused in memory as mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I].
    "qwen3moe": dict(cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig", kw=dict(vocab_size=96, hidden_size=32,
                     intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     tie_word_embeddings=False, max_position_embeddings=64)),
    # Mixtral: written on disk as block_sparse_moe.experts.{e}.w1/w2/w3.
    "mixtral": dict(cls="MixtralForCausalLM", cfg="MixtralConfig", kw=dict(vocab_size=96, hidden_size=32,
                    intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64)),
}

# job name -> (family, layout, world size)
JOBS = {
    "fsdp2_w2_llama": ("llama", "fsdp2", 2),
    "fsdp1_w2_llama": ("llama", "fsdp1", 2),
    "plain_w2_qwen3": ("qwen3", "plain_shards", 2),
    "fsdp2_w2_qwen3": ("qwen3", "fsdp2", 2),
    "fsdp2_w4_qwen2": ("qwen2", "fsdp2", 4),
    "hsdp_2x2_llama": ("llama", "hsdp", 4),
    "shard1_w4_qwen3": ("qwen3", "shard1", 4),
    "fsdp_tp_2x2_llama": ("llama", "fsdp_tp", 4),
    "plain_w1_qwen2": ("qwen2", "plain", 1),
    "moe_w2_qwen3moe": ("qwen3moe", "fsdp2", 2),
    "moe_w2_mixtral": ("mixtral", "fsdp2", 2),
    "dcp_w2_llama": ("llama", "dcp_nested", 2),
    "dcp_flat_w2_qwen3": ("qwen3", "dcp_flat", 2),
    "accelerate_w2_qwen2": ("qwen2", "accelerate", 2),
}

# LoRA jobs (llama, untied): peft.get_peft_model, then FSDP2 over the PEFT model, trained so lora_B is non-zero.
LORA = {
    "lora_qv_w2": dict(peft=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), form="verl", meta=True),
    "lora_all_dcp_w2": dict(peft=dict(r=4, lora_alpha=16, target_modules="all-linear"), form="dcp", meta=False),
    "lora_rs_w2": dict(peft=dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True), form="verl", meta=False),
    "lora_mts_w2": dict(peft=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]), form="verl", meta=True),
    "lora_dora_w2": dict(peft=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True), form="verl", meta=True),
}
for _j in LORA:
    JOBS[_j] = ("llama", "lora", 2)


def make_peft(job: str, seed: int = 0):
    """The PEFT model of a LoRA job, freshly initialised (load reference.pt into it to get the trained one)."""
    from peft import LoraConfig, get_peft_model

    base = make_model("llama", seed=seed)
    return get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA[job]["peft"]))


# Where each layout's checkpoint lives inside its job folder (what a user would point shardmerge at).
SOURCE_DIR = {"accelerate": "checkpoint-5"}


def source_of(out: Path, job: str) -> Path:
    """The path of a job's checkpoint."""
    return out / job / SOURCE_DIR.get(JOBS[job][1], "actor")


def make_config(family: str, **overrides):
    import transformers

    spec = FAMILIES[family]
    cfg = getattr(transformers, spec["cfg"])(**{**spec["kw"], **overrides})
    cfg.architectures = [spec["cls"]]
    return cfg


def make_model(family: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    cfg = make_config(family, **overrides)
    model = getattr(transformers, FAMILIES[family]["cls"])(cfg)
    return model


def write_tokenizer(folder: Path) -> None:
    """A tiny BPE tokenizer (``tokenizers``), with a chat template, saved the transformers way."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "sharded checkpoints merge into one model",
              "hello world", "tensor parallel pipeline parallel expert parallel"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    fast.save_pretrained(str(folder))


def write_hf_side(folder: Path, config) -> None:
    from transformers import GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3, do_sample=True, temperature=0.7, top_p=0.9).save_pretrained(str(folder))
    write_tokenizer(folder)


def _train(model, steps: int = 2, vocab: int = 90, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()


def _parallelize(model, layout: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if layout in ("fsdp2", "plain_shards", "dcp_nested", "dcp_flat", "accelerate"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ddp", "fsdp"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "shard1":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))

        def placement(p):
            return Shard(1) if p.ndim == 2 else Shard(0)

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    elif layout == "fsdp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        plan = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        layer_cls = type(model.model.layers[0])
        model = FSDP(model, device_id=torch.device("cpu"), device_mesh=mesh, use_orig_params=True,
                     auto_wrap_policy=ModuleWrapPolicy({layer_cls}))
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    else:
        raise ValueError(layout)
    return model


def _parallelize_peft(model, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full_state_dict(model, layout: str):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def _worker(rank: int, world: int, port: int, out: str, jobs: list[str]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for job in jobs:
            family, layout, w = JOBS[job]
            assert w == world, job
            folder = Path(out) / job
            actor = folder / "actor"
            if layout == "lora":
                model = make_peft(job)
                _parallelize_peft(model, world)
                torch.manual_seed(rank)  # ranks hold different slices; the data below is the same on all ranks
                _train(model, steps=3)
                layout = "dcp_nested" if LORA[job]["form"] == "dcp" else "lora"
            else:
                model = make_model(family, seed=0)
                model = _parallelize(model, layout, world)
                _train(model)
            full = _full_state_dict(model, layout)
            sd = model.state_dict()
            if layout == "plain_shards":
                sd = {k: v.to_local().clone() for k, v in sd.items()}
            if rank == 0:
                actor.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            if layout.startswith("dcp") or layout == "accelerate":
                import torch.distributed.checkpoint as dcp

                target = actor if layout != "accelerate" else folder / "checkpoint-5" / "pytorch_model_fsdp_0"
                dcp.save(sd if layout == "dcp_flat" else {"model": sd}, checkpoint_id=str(target))
            else:
                torch.save(sd, actor / f"model_world_size_{world}_rank_{rank}.pt")
            if rank == 0:
                torch.save({k: v.clone() for k, v in full.items()}, folder / "reference.pt")
                if job in LORA and LORA[job]["meta"]:
                    p = LORA[job]["peft"]
                    (actor / "lora_train_meta.json").write_text(json.dumps({"r": p["r"], "lora_alpha": p["lora_alpha"], "task_type": "CAUSAL_LM"}))
                if layout == "accelerate":
                    shutil.rmtree(actor)
                    write_hf_side(folder / "checkpoint-5", make_config(family))
                else:
                    if not layout.startswith("dcp"):
                        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1 if layout == "fsdp1" else 2, "world_size": world}, indent=4))
                    write_hf_side(actor / "huggingface", make_config(family))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def write_plain_w1(out: Path, job: str) -> None:
    family, _, _ = JOBS[job]
    folder = out / job
    actor = folder / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    model = make_model(family, seed=0)
    _train(model)
    sd = model.state_dict()
    torch.save(sd, actor / "model_world_size_1_rank_0.pt")
    torch.save({k: v.clone() for k, v in sd.items()}, folder / "reference.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    write_hf_side(actor / "huggingface", make_config(family))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(out: Path, jobs: list[str] | None = None, timeout: float = 600) -> None:
    """Write the given jobs (default: all) under ``out``, grouping them by world size, one subprocess each."""
    jobs = list(jobs or JOBS)
    by_world: dict[int, list[str]] = {}
    for j in jobs:
        by_world.setdefault(JOBS[j][2], []).append(j)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = []
    for world, js in sorted(by_world.items()):
        cmd = [sys.executable, __file__, str(out), str(world), *js]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        o, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"checkpoint writer failed ({' '.join(p.args[2:])}):\n{o[-4000:]}")


def main(argv: list[str]) -> None:
    out, world, jobs = Path(argv[0]), int(argv[1]), argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    if world == 1:
        for j in jobs:
            write_plain_w1(out, j)
        return
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, free_port(), str(out), jobs), nprocs=world, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])


def write_single(folder: Path, family: str, sd: dict | None = None, world: int = 1, **config_overrides) -> dict:
    """A W=1 verl-layout actor folder in this process (no process group): ``folder/model_world_size_1_rank_0.pt``.

    ``sd`` replaces the state dict (defaults to a fresh model's). Returns the state dict saved.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cfg = make_config(family, **config_overrides)
    if sd is None:
        import transformers

        torch.manual_seed(0)
        sd = getattr(transformers, FAMILIES[family]["cls"])(cfg).state_dict()
    torch.save(sd, folder / f"model_world_size_{world}_rank_0.pt")
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    write_hf_side(folder / "huggingface", cfg)
    return sd
