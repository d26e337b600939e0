"""Megatron -> HF conversion for the Llama/Mistral, Qwen2/2.5, Qwen3 and Mixtral/Qwen2-MoE/Qwen3-MoE families.

Layout facts (megatron-core 0.16; checked by comparing megatron-core's own forward with transformers' on the same
weights, see tests/megatron_writers.py):

* ``self_attention.linear_qkv`` [(nh + 2·ng)·d, H] (weight and bias) is laid out per query group g as
  ``[q rows of the g-th group's nh/ng heads (nh/ng·d), k (d), v (d)]``; d is ``kv_channels`` (HF ``head_dim``),
  which may differ from hidden/heads;
* a gated ``mlp.linear_fc1`` [2F, H] is all gate rows, then all up rows;
* the input norm is ``self_attention.linear_qkv.layer_norm_weight`` (Transformer Engine fused names; torch_dist uses
  them for the local spec too) or ``input_layernorm.weight``; the post-attention norm ``mlp.linear_fc1.layer_norm_weight``
  or ``pre_mlp_layernorm.weight``; ``q_layernorm`` / ``k_layernorm`` are HF ``q_norm`` / ``k_norm``;
* the vocabulary is padded (``padded_vocab_size``): rows beyond the HF config's ``vocab_size`` are dropped;
* MoE: ``mlp.router.weight`` is HF ``mlp.gate.weight``; experts ``mlp.experts.local_experts.{e}.linear_fc1/fc2`` (per
  layer) or ``mlp.experts.experts.linear_fc1/fc2`` [L, E, ...] (torch_dist) become transformers 5's fused in-memory
  ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], which :mod:`shardmerge.convert.moe` writes in the
  layout ``save_pretrained`` uses; ``mlp.shared_experts.*`` are Qwen2-MoE's ``mlp.shared_expert.*``;
* multi-token-prediction layers (``mtp.*``) are dropped unless kept on request (a declared addition);
* without ``output_layer`` the model was trained with tied embeddings; that must agree with the config.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

from ..errors import ConversionError
from ..formats.base import Assembled, Piece, Sliced, SourceCheckpoint, TensorSource, Unsqueezed, full_box
from .expected import ExpectedModel
from .hf import Converted, _listing, finalize


# Per-layer Megatron names that map one-to-one onto HF names (TE-fused and local-spec norm names both occur).
RENAMES = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}


def _cfg(exp: ExpectedModel) -> dict:
    raw = json.loads((exp.config_dir / "config.json").read_text()) if exp.config_dir else {}
    return {**(raw.get("text_config") or {}), **raw} if "text_config" in raw else raw


def _unstack(tensors: dict[str, TensorSource]) -> tuple[dict[str, TensorSource], list[str]]:
    """Layer-stacked torch_dist keys -> per-layer (and per-expert) keys."""
    out: dict[str, TensorSource] = {}
    notes = []
    for k, t in tensors.items():
        m = re.match(r"^(decoder|mtp)\.layers\.(?!\d+\.)(.+)$", k)
        if not m:
            out[k] = t
            continue
        rest = m.group(2)
        experts = re.match(r"^mlp\.experts\.(?:experts|local_experts)\.(.+)$", rest)
        for i in range(t.shape[0]):
            if experts:
                for e in range(t.shape[1]):
                    region = ((i, i + 1), (e, e + 1)) + full_box(t.shape)[2:]
                    out[f"{m.group(1)}.layers.{i}.mlp.experts.local_experts.{e}.{experts.group(1)}"] = Sliced(t, region, (0, 1))
            else:
                out[f"{m.group(1)}.layers.{i}.{rest}"] = Sliced(t, ((i, i + 1),) + full_box(t.shape)[1:], (0,))
    if len(out) != len(tensors):
        notes.append("layer-stacked torch_dist tensors split per layer")
    return out, notes


def _rows(t: TensorSource, a: int, b: int) -> TensorSource:
    return Sliced(t, ((a, b),) + full_box(t.shape)[1:])


def _gate_up(t: TensorSource) -> tuple[TensorSource, TensorSource]:
    """A gated ``linear_fc1`` [2F, H]: all gate rows, then all up rows."""
    half = t.shape[0] // 2
    return _rows(t, 0, half), _rows(t, half, 2 * half)


def _split_qkv(name: str, t: TensorSource, nh: int, ng: int, d: int) -> dict[str, TensorSource]:
    qpg = nh // ng
    group = (qpg + 2) * d
    if t.shape[0] != ng * group:
        raise ConversionError(f"{name}: {t.shape[0]} rows, expected (heads {nh} + 2 x groups {ng}) x head_dim {d} = {ng * group}")
    rest = full_box(t.shape)[1:]
    parts: dict[str, list[Piece]] = {"q": [], "k": [], "v": []}
    for g in range(ng):
        base = g * group
        for which, (a, n, off) in {"q": (base, qpg * d, g * qpg * d), "k": (base + qpg * d, d, g * d),
                                   "v": (base + (qpg + 1) * d, d, g * d)}.items():
            parts[which].append(Piece((off,) + (0,) * len(rest), Sliced(t, ((a, a + n),) + rest), where=name))
    out = {}
    for which, n in (("q", nh * d), ("k", ng * d), ("v", ng * d)):
        a = Assembled(f"{name}[{which}]", (n,) + tuple(t.shape[1:]), t.dtype, parts[which], check_replicas=False)
        a.validate()
        out[which] = a
    return out


def _stack_experts(name: str, per_expert: dict[int, TensorSource], rows: tuple[int, int] | None = None) -> TensorSource:
    experts = sorted(per_expert)
    if experts != list(range(len(experts))):
        raise ConversionError(f"{name}: experts {experts} are not 0..{len(experts) - 1}")
    first = per_expert[0]
    shape = tuple(first.shape) if rows is None else (rows[1] - rows[0],) + tuple(first.shape[1:])
    pieces = []
    for e in experts:
        src = per_expert[e] if rows is None else _rows(per_expert[e], *rows)
        pieces.append(Piece((e,) + (0,) * len(shape), Unsqueezed(src), where=name))
    a = Assembled(name, (len(experts),) + shape, first.dtype, pieces, check_replicas=False)
    a.validate()
    return a


def convert_megatron(ckpt: SourceCheckpoint, exp: ExpectedModel, tie_word_embedding: bool | None = None,
                     keep_mtp: bool = False) -> Converted:
    """Megatron global names/layouts (from :mod:`shardmerge.formats.megatron`) -> the HF on-disk key set of ``exp``.

    Raises:
        ConversionError: unknown Megatron keys (listed), shapes that contradict the config (heads, head_dim,
            vocabulary), a tie contradiction, or a key set that differs from ``save_pretrained``'s.
    """
    c = _cfg(exp)
    H = int(c["hidden_size"])
    nh = int(c["num_attention_heads"])
    ng = int(c.get("num_key_value_heads") or nh)
    d = int(c.get("head_dim") or H // nh)
    vocab = int(c["vocab_size"])
    tensors, notes = _unstack(ckpt.tensors)
    out: dict[str, TensorSource] = {}
    unknown: list[str] = []
    mtp: dict[str, TensorSource] = {}
    experts: dict[tuple[int, str], dict[int, TensorSource]] = defaultdict(dict)

    def vocab_rows(name: str, t: TensorSource) -> TensorSource:
        if t.shape[0] < vocab:
            raise ConversionError(f"{name}: {t.shape[0]} rows but the config's vocab_size is {vocab}")
        if t.shape[0] > vocab:
            notes.append(f"{name}: padded vocabulary {t.shape[0]} trimmed to vocab_size {vocab}")
            return _rows(t, 0, vocab)
        return t

    for k, t in tensors.items():
        if k.startswith("mtp."):
            mtp[k] = t
            continue
        if k == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = vocab_rows(k, t)
            continue
        if k == "output_layer.weight":
            out["lm_head.weight"] = vocab_rows(k, t)
            continue
        if k == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
            continue
        m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", k)
        if not m:
            unknown.append(k)
            continue
        i, rest = int(m.group(1)), m.group(2)
        p = f"model.layers.{i}."
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            suffix = rest.rsplit(".", 1)[1]
            for which, src in _split_qkv(k, t, nh, ng, d).items():
                out[f"{p}self_attn.{which}_proj.{suffix}"] = src
        elif rest in RENAMES:
            out[p + RENAMES[rest]] = t
        elif rest == "mlp.linear_fc1.weight":
            out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = _gate_up(t)
        elif rest == "mlp.shared_experts.linear_fc1.weight":
            out[f"{p}mlp.shared_expert.gate_proj.weight"], out[f"{p}mlp.shared_expert.up_proj.weight"] = _gate_up(t)
        else:
            me = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$", rest)
            if me:
                experts[(i, me.group(2))][int(me.group(1))] = t
            else:
                unknown.append(k)
    if unknown:
        raise ConversionError(f"{ckpt.path}: Megatron keys this converter does not know: {_listing(unknown)}")
    for (i, which), per in sorted(experts.items()):
        p = f"model.layers.{i}.mlp.experts."
        if which == "linear_fc1":
            out[p + "gate_up_proj"] = _stack_experts(f"layer {i} experts fc1", per)
        else:
            out[p + "down_proj"] = _stack_experts(f"layer {i} experts fc2", per)
    if "lm_head.weight" not in out and not exp.tie_word_embeddings and "model.embed_tokens.weight" in out:
        raise ConversionError(
            f"{ckpt.path} has no output_layer (trained with tied embeddings) but the config says "
            "tie_word_embeddings=false; fix the config"
        )
    if "lm_head.weight" in out and exp.tie_word_embeddings:
        notes.append("the checkpoint holds output_layer while the config ties embeddings: checked equal below")
    additions = {}
    if mtp:
        if keep_mtp:
            additions = dict(mtp)
        else:
            notes.append(f"dropped {len(mtp)} multi-token-prediction tensors (mtp.*); --keep-mtp keeps them")
    conv = finalize(out, exp, str(ckpt.path), tie_word_embedding, additions)
    conv.notes = notes + conv.notes
    return conv


def synthesize_config(args: dict, where: str = ""):
    """An HF config (transformers' own config class) from Megatron arguments, for the supported families:
    ``qk_layernorm`` -> Qwen3 (Qwen3-MoE with experts), ``add_qkv_bias`` -> Qwen2 (Qwen2-MoE with experts),
    experts otherwise -> Mixtral, else Llama. Requires RMSNorm, SwiGLU and rotary embeddings.

    Raises:
        ConversionError: arguments missing or describing a model outside these families.
    """
    import transformers

    need = ("num_layers", "hidden_size", "num_attention_heads")
    missing = [k for k in need if not args.get(k)]
    if missing:
        raise ConversionError(f"{where}: no HF config found and the Megatron arguments lack {', '.join(missing)}; pass --hf-model-config-path")
    norm = str(args.get("normalization") or "RMSNorm")
    if norm != "RMSNorm" or not args.get("swiglu", True) or (args.get("position_embedding_type") or "rope") != "rope":
        raise ConversionError(
            f"{where}: cannot synthesize an HF config for normalization={norm}, swiglu={args.get('swiglu')}, "
            f"position_embedding_type={args.get('position_embedding_type')}; pass --hf-model-config-path"
        )
    nh = int(args["num_attention_heads"])
    ng = int(args.get("num_query_groups") or nh) if args.get("group_query_attention", True) else nh
    experts = int(args.get("num_experts") or 0)
    kw = dict(
        vocab_size=int(args.get("vocab_size") or args.get("padded_vocab_size")),
        hidden_size=int(args["hidden_size"]), intermediate_size=int(args.get("ffn_hidden_size") or 4 * int(args["hidden_size"])),
        num_hidden_layers=int(args["num_layers"]), num_attention_heads=nh, num_key_value_heads=ng,
        max_position_embeddings=int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
        rms_norm_eps=float(args.get("norm_epsilon") or args.get("layernorm_epsilon") or 1e-5),
        tie_word_embeddings=not bool(args.get("untie_embeddings_and_output_weights", False)),
        rope_parameters={"rope_type": "default", "rope_theta": float(args.get("rotary_base") or 10000.0)},
    )
    head_dim = args.get("kv_channels")
    if args.get("qk_layernorm"):
        cls = "Qwen3MoeConfig" if experts else "Qwen3Config"
        kw["head_dim"] = int(head_dim or kw["hidden_size"] // nh)
    elif args.get("add_qkv_bias"):
        cls = "Qwen2MoeConfig" if experts else "Qwen2Config"
    elif experts:
        cls = "MixtralConfig"
    else:
        cls = "LlamaConfig"
        if head_dim:
            kw["head_dim"] = int(head_dim)
    if experts:
        topk = int(args.get("moe_router_topk") or 2)
        if cls == "MixtralConfig":
            kw.update(num_local_experts=experts, num_experts_per_tok=topk, intermediate_size=int(args.get("moe_ffn_hidden_size") or kw["intermediate_size"]))
        else:
            kw.update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=int(args.get("moe_ffn_hidden_size") or kw["intermediate_size"]),
                      norm_topk_prob=not bool(args.get("moe_router_pre_softmax", False)))
            if cls == "Qwen2MoeConfig":
                kw["shared_expert_intermediate_size"] = int(args.get("moe_shared_expert_intermediate_size") or 0)
    config = getattr(transformers, cls)(**kw)
    config.architectures = [cls.replace("Config", "ForCausalLM")]
    return config
