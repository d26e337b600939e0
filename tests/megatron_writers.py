"""Real Megatron checkpoints written by megatron-core 0.16.1 on CPU/gloo (run as a script).

    python tests/megatron_writers.py OUT JOB [JOB ...] [--reference]

A tiny HF model (``ckpt_writers.FAMILIES``) is copied into a megatron-core ``GPTModel`` (local layer spec, RMSNorm,
SwiGLU) under the job's tensor / pipeline / expert parallel sizes, then saved the way Megatron-LM saves:

* ``OUT/JOB/torch_dist/iter_0000100/`` by ``dist_checkpointing.save`` (``.metadata``, ``__R_K.distcp``, ``common.pt``
  holding ``args``/``iteration``, ``metadata.json``) and ``latest_checkpointed_iteration.txt``;
* ``OUT/JOB/legacy/iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` (each rank's ``state_dict()``);
* ``OUT/JOB/hf/`` the HF model (``save_pretrained``): the weights every merge is compared with, and its config;
* ``OUT/JOB/logits.pt``: Megatron's own forward (TP=PP=EP=1, same weights) on ``TOKENS``.

The CUDA calls megatron-core makes unconditionally are replaced by no-ops (FIXTURES.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ckpt_writers  # noqa: E402

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 11, 70, 3]])
ITER = 100

# job -> parallel layout (world = tp * pp * dp; experts split over ep within dp)
JOBS = {
    "mg_tp2_qwen2": dict(family="qwen2", tp=2, pp=1, ep=1, world=2, vocab_pad=104),      # qkv bias, tied, padded vocab
    "mg_pp2_llama": dict(family="llama", tp=1, pp=2, ep=1, world=2, vocab_pad=96),       # GQA, untied
    "mg_tp2pp2_qwen3": dict(family="qwen3", tp=2, pp=2, ep=1, world=4, vocab_pad=104),   # kv_channels 16 != 32/4, qk norm
    "mg_ep2_qwen3moe": dict(family="qwen3moe", tp=1, pp=1, ep=2, world=2, vocab_pad=96),  # 4 experts, 2 per rank
}


def cuda_stand_ins() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def bypass_rng_tracker() -> None:
    import megatron.core.tensor_parallel.random as rnd

    tracker = rnd.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()


def hf_model(job: str):
    torch.manual_seed(0)
    model = ckpt_writers.make_model(JOBS[job]["family"], seed=0)
    with torch.no_grad():  # not the init distribution: make norms and biases informative too
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def megatron_config(hcfg, spec: dict, tp: int, pp: int, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = getattr(hcfg, "num_experts", None)
    kw = dict(
        num_layers=hcfg.num_hidden_layers, hidden_size=hcfg.hidden_size, num_attention_heads=hcfg.num_attention_heads,
        num_query_groups=hcfg.num_key_value_heads, ffn_hidden_size=hcfg.intermediate_size, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=spec["family"] == "qwen2", qk_layernorm=spec["family"] in ("qwen3", "qwen3moe"),
        layernorm_epsilon=hcfg.rms_norm_eps, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        kv_channels=getattr(hcfg, "head_dim", None) or hcfg.hidden_size // hcfg.num_attention_heads,
    )
    if moe:
        kw.update(num_moe_experts=moe, moe_router_topk=hcfg.num_experts_per_tok, moe_ffn_hidden_size=hcfg.moe_intermediate_size,
                  expert_model_parallel_size=ep, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  moe_router_pre_softmax=True)  # HF Qwen3-MoE: softmax over all experts, then top-k (norm_topk_prob=False)
    return TransformerConfig(**kw)


def build_gpt(job: str, hcfg, tp: int, pp: int, ep: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = JOBS[job]
    cfg = megatron_config(hcfg, spec, tp, pp, ep)
    layer_spec = get_gpt_layer_local_spec(num_experts=getattr(hcfg, "num_experts", None), normalization="RMSNorm",
                                          qk_layernorm=cfg.qk_layernorm)
    return GPTModel(config=cfg, transformer_layer_spec=layer_spec, vocab_size=spec["vocab_pad"], max_sequence_length=64,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=hcfg.tie_word_embeddings, position_embedding_type="rope",
                    rotary_base=hcfg.rope_parameters["rope_theta"]).eval()


def hf_to_megatron(job: str, sd: dict, hcfg) -> dict:
    """Full (TP=PP=EP=1) Megatron state dict, global layer indices: the layout facts the converter inverts."""
    spec = JOBS[job]
    nh, ng = hcfg.num_attention_heads, hcfg.num_key_value_heads
    d = getattr(hcfg, "head_dim", None) or hcfg.hidden_size // nh
    qpg = nh // ng

    def pad(t):
        out = torch.zeros(spec["vocab_pad"], t.shape[1])
        out[: t.shape[0]] = t
        return out

    new = {"embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]), "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not hcfg.tie_word_embeddings:
        new["output_layer.weight"] = pad(sd["lm_head.weight"])
    for i in range(hcfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suf in ("weight", "bias"):
            if p + "self_attn.q_proj." + suf not in sd:
                continue
            qs, ks, vs = (sd[p + f"self_attn.{n}_proj." + suf] for n in "qkv")
            parts = []
            for g in range(ng):  # Megatron fused QKV layout: per query group [q x qpg, k, v]
                parts += [qs[g * qpg * d:(g + 1) * qpg * d], ks[g * d:(g + 1) * d], vs[g * d:(g + 1) * d]]
            new[q + "self_attention.linear_qkv." + suf] = torch.cat(parts)
        new[q + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        new[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        new[q + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        if p + "self_attn.q_norm.weight" in sd:
            new[q + "self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"]
            new[q + "self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"]
        if p + "mlp.gate_proj.weight" in sd:
            new[q + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
            new[q + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
        else:  # fused in-memory experts [E, 2I, H] / [E, H, I]
            new[q + "mlp.router.weight"] = sd[p + "mlp.gate.weight"]
            gu, dn = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            for e in range(gu.shape[0]):
                new[q + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = gu[e].clone()
                new[q + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = dn[e].clone()
    return new


COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def local_state_dict(full: dict, hcfg, tp_rank: int, tp: int, pp_rank: int, pp: int, ep_rank: int, ep: int) -> dict:
    """This rank's slice of the full Megatron state dict (local layer and expert indices)."""
    import re

    L = hcfg.num_hidden_layers
    per_stage = L // pp
    n_exp = getattr(hcfg, "num_experts", 0) or 0
    local_e = n_exp // ep if n_exp else 0
    out = {}
    for k, v in full.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", k)
        if m:
            i = int(m.group(1))
            if not pp_rank * per_stage <= i < (pp_rank + 1) * per_stage:
                continue
            rest = m.group(2)
            me = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)", rest)
            if me:
                e = int(me.group(1))
                if not ep_rank * local_e <= e < (ep_rank + 1) * local_e:
                    continue
                rest = f"mlp.experts.local_experts.{e - ep_rank * local_e}.{me.group(2)}"
            k = f"decoder.layers.{i - pp_rank * per_stage}.{rest}"
        elif k.startswith("embedding.") and pp_rank != 0 or k.startswith(("output_layer.", "decoder.final_layernorm")) and pp_rank != pp - 1:
            continue
        if k.endswith("linear_fc1.weight") and "experts" not in k:  # gated: each TP rank holds [gate_r; up_r]
            half = v.shape[0] // 2
            gate, up = v[:half].chunk(tp)[tp_rank], v[half:].chunk(tp)[tp_rank]
            v = torch.cat([gate, up])
        elif k.endswith(COLUMN):
            v = v.chunk(tp, dim=0)[tp_rank]
        elif k.endswith(ROW) and "experts" not in k:
            v = v.chunk(tp, dim=1)[tp_rank]
        out[k] = v.clone()
    return out


def args_namespace(job: str, hcfg):
    import argparse as ap

    spec = JOBS[job]
    return ap.Namespace(
        num_layers=hcfg.num_hidden_layers, hidden_size=hcfg.hidden_size, ffn_hidden_size=hcfg.intermediate_size,
        num_attention_heads=hcfg.num_attention_heads, num_query_groups=hcfg.num_key_value_heads,
        group_query_attention=hcfg.num_key_value_heads != hcfg.num_attention_heads,
        kv_channels=getattr(hcfg, "head_dim", None) or hcfg.hidden_size // hcfg.num_attention_heads,
        padded_vocab_size=spec["vocab_pad"], vocab_size=hcfg.vocab_size, max_position_embeddings=hcfg.max_position_embeddings,
        norm_epsilon=hcfg.rms_norm_eps, normalization="RMSNorm", swiglu=True, add_qkv_bias=spec["family"] == "qwen2",
        qk_layernorm=spec["family"] in ("qwen3", "qwen3moe"), untie_embeddings_and_output_weights=not hcfg.tie_word_embeddings,
        rotary_base=hcfg.rope_parameters["rope_theta"], position_embedding_type="rope",
        tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"],
        expert_model_parallel_size=spec["ep"], virtual_pipeline_model_parallel_size=None,
        num_experts=getattr(hcfg, "num_experts", None), moe_router_topk=getattr(hcfg, "num_experts_per_tok", 2),
        moe_ffn_hidden_size=getattr(hcfg, "moe_intermediate_size", None), moe_router_pre_softmax=True,
        params_dtype=torch.float32, bf16=False, fp16=False,
        ckpt_format="torch_dist",
    )


def _worker(rank: int, job: str, out: str, port: int) -> None:
    import torch.distributed as dist

    spec = JOBS[job]
    world = spec["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cuda_stand_ins()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(spec["tp"], spec["pp"], expert_model_parallel_size=spec["ep"])
    hf = hf_model(job)
    full = hf_to_megatron(job, hf.state_dict(), hf.config)
    tp_r, pp_r = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep_r = ps.get_expert_model_parallel_rank()
    model = build_gpt(job, hf.config, spec["tp"], spec["pp"], spec["ep"])
    local = local_state_dict(full, hf.config, tp_r, spec["tp"], pp_r, spec["pp"], ep_r, spec["ep"])
    missing, unexpected = model.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    root = Path(out) / job
    args = args_namespace(job, hf.config)
    state = {"model": model.sharded_state_dict(), "args": args, "iteration": ITER, "checkpoint_version": 3.0}
    it = root / "torch_dist" / f"iter_{ITER:07d}"
    if rank == 0:
        it.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(it))
    name = f"mp_rank_{tp_r:02d}" + (f"_{pp_r:03d}" if spec["pp"] > 1 else "") + (f"_{ep_r:03d}" if spec["ep"] > 1 else "")
    dp_r = ps.get_data_parallel_rank()
    if dp_r == 0 or spec["ep"] > 1:  # Megatron-LM: one file per (tp, pp[, ep]) rank
        legacy = root / "legacy" / f"iter_{ITER:07d}" / name
        legacy.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "args": args, "iteration": ITER, "checkpoint_version": 3.0}, legacy / "model_optim_rng.pt")
    dist.barrier()
    if rank == 0:
        for sub in ("torch_dist", "legacy"):
            (root / sub / "latest_checkpointed_iteration.txt").write_text(str(ITER))
        hf.save_pretrained(str(root / "hf"))
        ckpt_writers.write_tokenizer(root / "hf")
    dist.barrier()
    dist.destroy_process_group()


def reference_logits(jobs: list[str], out: str) -> None:
    """Megatron's own forward on the full weights (one process, TP=PP=EP=1)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ckpt_writers.free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cuda_stand_ins()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state as ps

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16.1 reads this name even without Transformer Engine
    ps.initialize_model_parallel(1, 1)
    bypass_rng_tracker()
    for job in jobs:
        hf = hf_model(job)
        model = build_gpt(job, hf.config, 1, 1, 1)
        missing, unexpected = model.load_state_dict(hf_to_megatron(job, hf.state_dict(), hf.config), strict=False)
        assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
        n = TOKENS.shape[1]
        with torch.no_grad():
            logits = model(input_ids=TOKENS, position_ids=torch.arange(n).unsqueeze(0),
                           attention_mask=torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool())
        Path(out, job).mkdir(parents=True, exist_ok=True)
        torch.save(logits[..., : hf.config.vocab_size].clone(), Path(out) / job / "logits.pt")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("job", nargs="+", choices=list(JOBS))
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    if args.reference:
        reference_logits(args.job, args.out)
        return
    import torch.multiprocessing as mp

    for job in args.job:
        mp.spawn(_worker, args=(job, args.out, ckpt_writers.free_port()), nprocs=JOBS[job]["world"], join=True)


def build(out: Path, jobs: list[str] | None = None) -> None:
    """Write the jobs (each a checkpoint run plus a reference run, as subprocesses)."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    jobs = jobs or list(JOBS)
    procs = [subprocess.Popen([sys.executable, __file__, str(out), *jobs, *extra], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for extra in ([], ["--reference"])]
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"megatron writer failed ({' '.join(p.args[2:])}):\n{err[-4000:]}")


if __name__ == "__main__":
    main()
