"""shardmerge quickstart: write a real FSDP2 checkpoint with 2 processes, merge it, check the model.

1. Two gloo processes train a tiny Qwen2-style model with torch FSDP2 (``fully_shard``) for a few steps and save
   it the way verl does: one ``model_world_size_2_rank_R.pt`` per rank plus ``huggingface/`` (config, tokenizer).
2. ``shardmerge.merge`` turns that folder into a HuggingFace directory.
3. ``AutoModelForCausalLM.from_pretrained`` loads it; its logits are compared with the trained model's own
   (gathered by torch), in the written dtype.

    python examples/quickstart.py [--workdir DIR] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def tiny_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128)
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["sharded checkpoints become one model", "hello world"] * 10,
                            trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(str(folder))


def train_and_save(rank: int, world: int, port: int, ckpt: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, 100, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    folder = Path(ckpt)
    torch.save(model.state_dict(), folder / f"model_world_size_{world}_rank_{rank}.pt")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, folder.parent / "trained_full_state_dict.pt")
        (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
        tiny_config().save_pretrained(str(folder / "huggingface"))
        save_tokenizer(folder / "huggingface")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where to write the checkpoint and the HF directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardmerge-quickstart-"))
    ckpt = work / "global_step_3" / "actor"
    ckpt.mkdir(parents=True, exist_ok=True)

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"[1/3] training a tiny model with FSDP2 on 2 processes and saving it to {ckpt}")
    mp.spawn(train_and_save, args=(2, port, str(ckpt)), nprocs=2, join=True)

    import shardmerge

    out = work / "global_step_3" / "actor_hf"
    print(f"[2/3] shardmerge merge {ckpt} -> {out}")
    report = shardmerge.merge(ckpt, out, dtype=args.dtype, overwrite=True)
    print(f"      {report.tensors} tensors, {report.bytes / 1e6:.2f} MB, files {report.files}, {report.seconds:.2f} s")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()
    trained = AutoModelForCausalLM.from_config(tiny_config(), dtype=dtype).eval()
    full = torch.load(work / "global_step_3" / "trained_full_state_dict.pt")
    trained.load_state_dict({k: v.to(dtype) for k, v in full.items()})
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("sharded checkpoints become one model", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, trained(input_ids=ids).logits
    same = torch.equal(a, b)
    print(f"[3/3] from_pretrained({out.name}) logits {'EQUAL' if same else 'DIFFER'} to the trained model's "
          f"({args.dtype}, {ids.shape[1]} tokens, max |diff| {float((a.float() - b.float()).abs().max()):.3g})")
    if not same:
        raise SystemExit(1)
    print(f"OK: {out} is the trained model")


if __name__ == "__main__":
    main()
