"""Readers for Megatron checkpoints, without importing megatron and without a GPU.

**torch_dist** (megatron-core ``dist_checkpointing``, Megatron-LM's default ``--ckpt-format``): a DCP folder
(``.metadata`` + ``__R_K.distcp``, read by :mod:`shardmerge.formats.dcp`) plus ``common.pt`` (non-sharded state:
``args``, ``iteration``) and ``metadata.json``, written last: the completion marker. Keys are global: layer-stacked
``decoder.layers.<param>`` with a leading layer axis [L, ...] (experts [L, E, ...]), or per-layer; tensor-parallel
pieces are chunks of the global tensor, and a gated ``linear_fc1`` is stored as all gate rows then all up rows
whatever the TP size (megatron-core's swiglu sharded factory).

**Legacy** ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` trees: each (tensor, pipeline[, expert]) rank's
``state_dict()`` with local layer and expert indices. Placement facts (Megatron-LM ``get_checkpoint_name`` and
megatron-core's parallel layers): column-parallel weights (``linear_qkv``, ``linear_fc1``, vocabulary-parallel
``word_embeddings`` and ``output_layer``) are split along dim 0 and row-parallel ones (``linear_proj``,
``linear_fc2``) along dim 1; norms and the router are replicated; each TP piece of a gated ``linear_fc1`` is
``[gate_r; up_r]``; pipeline stage p (virtual chunk v) holds global layers ``v·L/V + p·L/(P·V) + l``; expert rank r
holds global experts ``r·E/EP + e``. The reader assembles these into the same global names and layouts as torch_dist.

Folders: Megatron-LM roots (``latest_checkpointed_iteration.txt`` + ``iter_0000100/``), verl's ``dist_ckpt/`` and
``model/dist_ckpt/`` (beside ``ckpt_contents.json``) layouts. Only model entries are read: not optimizer, RNG,
scheduler or ``_extra_state``.
"""

from __future__ import annotations

import itertools
import json
import re
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

from ..errors import SourceError, UnsupportedSourceError
from .base import Assembled, FilePool, Piece, ShapeOracle, Sliced, SourceCheckpoint, TensorSource, full_box
from .torchzip import TorchZip

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                   "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
ARG_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "group_query_attention",
    "kv_channels", "padded_vocab_size", "vocab_size", "max_position_embeddings", "norm_epsilon", "layernorm_epsilon",
    "normalization", "swiglu", "add_qkv_bias", "add_bias_linear", "qk_layernorm", "untie_embeddings_and_output_weights",
    "rotary_base", "rotary_percent", "position_embedding_type", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "virtual_pipeline_model_parallel_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_router_pre_softmax", "mtp_num_layers", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "ckpt_format", "bf16", "fp16", "seq_length",
)


def dist_dir(p: Path) -> Path | None:
    """The torch_dist folder at or below ``p`` (verl's ``model/dist_ckpt/`` and ``dist_ckpt/`` included)."""
    for c in (p / "model" / "dist_ckpt", p / "dist_ckpt", p):
        if (c / ".metadata").is_file() or (c / "metadata.json").is_file() or (c / "common.pt").is_file():
            return c
    return None


def rank_dirs(p: Path) -> list[Path]:
    return sorted(c for c in p.iterdir() if c.is_dir() and RANK_DIR.match(c.name)) if p.is_dir() else []


def _args_dict(args: Any) -> dict:
    if args is None:
        return {}
    src = vars(args) if isinstance(args, Namespace) else getattr(args, "__dict__", {}) if not isinstance(args, dict) else args
    out = {}
    for k in ARG_FIELDS:
        v = src.get(k)
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        elif isinstance(v, torch.dtype):
            out[k] = str(v).replace("torch.", "")
    return out


def read_args(path: Path, trust_pickle: bool = False) -> dict:
    """Megatron arguments recorded with a checkpoint (``common.pt``, a legacy rank file, verl's
    ``transformer_config.json``), as a dict of plain values; empty when none are recorded."""
    pool = FilePool()
    try:
        d = dist_dir(path)
        if d is not None and (d / "common.pt").is_file():
            common = TorchZip(str(d / "common.pt"), pool).load(trust=trust_pickle)
            if isinstance(common, dict) and common.get("args") is not None:
                return _args_dict(common["args"])
        ranks = rank_dirs(path)
        if ranks:
            f = _rank_file(ranks[0])
            obj = TorchZip(str(f), pool).load(trust=trust_pickle)
            return _args_dict(obj.get("args")) if isinstance(obj, dict) else {}
        for tc in (path / "transformer_config.json", path.parent / "transformer_config.json", path.parent.parent / "transformer_config.json"):
            if tc.is_file():
                return _args_dict(_transformer_config_as_args(json.loads(tc.read_text())))
    finally:
        pool.close()
    return {}


def _transformer_config_as_args(tc: dict) -> dict:
    """verl's ``transformer_config.json`` (a megatron TransformerConfig) in Megatron-LM argument names."""
    out = dict(tc)
    out.setdefault("norm_epsilon", tc.get("layernorm_epsilon"))
    out.setdefault("swiglu", tc.get("gated_linear_unit"))
    out.setdefault("num_experts", tc.get("num_moe_experts"))
    return out


def _rank_file(d: Path) -> Path:
    for name in ("model_optim_rng.pt", "model_rng.pt"):
        if (d / name).is_file():
            return d / name
    raise SourceError(f"{d}: no model_optim_rng.pt or model_rng.pt")


def read_megatron(
    path: Path,
    pool: FilePool,
    shape_oracle: ShapeOracle,
    trust_pickle: bool = False,
    check_replicas: bool = True,
) -> SourceCheckpoint:
    """Describe the model tensors of a Megatron checkpoint folder in global Megatron names (no data read).

    Raises:
        SourceError: a torch_dist folder without ``metadata.json`` (save in progress), missing rank files (named),
            inconsistent pieces.
        UnsupportedSourceError: a non-torch_dist sharded backend (zarr), uneven pipeline stages.
    """
    if rank_dirs(path):
        return read_legacy(path, pool, trust_pickle, check_replicas)
    d = dist_dir(path)
    if d is None:
        raise SourceError(f"{path}: no Megatron checkpoint (looked for mp_rank_* folders, metadata.json/.metadata, dist_ckpt/)")
    return read_torch_dist(d, pool, trust_pickle, check_replicas)


def read_torch_dist(d: Path, pool: FilePool, trust_pickle: bool = False, check_replicas: bool = True) -> SourceCheckpoint:
    from .dcp import read_dcp

    meta = d / "metadata.json"
    if not meta.is_file():
        raise SourceError(
            f"{d} has no metadata.json: the Megatron save is still in progress (metadata.json is written last) or was interrupted"
        )
    try:
        info = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise SourceError(f"{meta} is not valid JSON ({e})") from None
    backend = info.get("sharded_backend")
    if backend != "torch_dist":
        raise UnsupportedSourceError(f"{meta}: sharded backend {backend!r} is not supported (only torch_dist)")
    args: dict = {}
    iteration = None
    if (d / "common.pt").is_file():
        common = TorchZip(str(d / "common.pt"), pool).load(trust=trust_pickle)
        if isinstance(common, dict):
            args = _args_dict(common.get("args"))
            iteration = common.get("iteration")
    ck = read_dcp(d, pool, lambda n: None, trust_pickle, check_replicas)
    tensors = {k: t for k, t in ck.tensors.items() if not k.endswith("_extra_state") and not k.startswith(("rng_state", "optimizer"))}
    notes = list(ck.notes)
    return SourceCheckpoint(
        format="megatron",
        path=str(d),
        tensors=tensors,
        world_size=ck.world_size,
        mesh=_mesh(args) or ck.mesh,
        placements=ck.placements,
        notes=notes,
        step=iteration if isinstance(iteration, int) else None,
        files=ck.files,
        extra={"megatron_args": args, "megatron_format": "torch_dist"},
    )


def _mesh(args: dict) -> str | None:
    if not args:
        return None
    return (f"(tp={args.get('tensor_model_parallel_size') or 1}, pp={args.get('pipeline_model_parallel_size') or 1}, "
            f"ep={args.get('expert_model_parallel_size') or 1})")


def read_legacy(path: Path, pool: FilePool, trust_pickle: bool = False, check_replicas: bool = True) -> SourceCheckpoint:
    dirs = rank_dirs(path)
    first = TorchZip(str(_rank_file(dirs[0])), pool).load(trust=trust_pickle)
    args = _args_dict(first.get("args") if isinstance(first, dict) else None)
    if not args:
        raise SourceError(f"{_rank_file(dirs[0])} records no Megatron args: cannot tell the parallel layout")
    tp = int(args.get("tensor_model_parallel_size") or 1)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    ep = int(args.get("expert_model_parallel_size") or 1)
    vp = int(args.get("virtual_pipeline_model_parallel_size") or 1)
    etp = int(args.get("expert_tensor_parallel_size") or tp)
    L = int(args["num_layers"])
    E = int(args.get("num_experts") or 0)
    if args.get("decoder_first_pipeline_num_layers") or args.get("decoder_last_pipeline_num_layers"):
        raise UnsupportedSourceError(f"{path}: uneven pipeline stages (decoder_first/last_pipeline_num_layers) are not supported")
    if L % (pp * vp):
        raise UnsupportedSourceError(f"{path}: {L} layers do not split evenly over pp={pp} x vp={vp}")
    found: dict[tuple[int, int, int], Path] = {}
    for d in dirs:
        m = RANK_DIR.match(d.name)
        a, b, c = (int(x) if x is not None else None for x in m.groups())
        if pp > 1:
            key = (a, b or 0, c or 0)
        else:  # mp_rank_TT_EEE when there is no pipeline parallelism
            key = (a, 0, b or 0) if c is None else (a, b, c)
        found[key] = _rank_file(d)
    expected = list(itertools.product(range(tp), range(pp), range(ep)))
    missing = [k for k in expected if k not in found]
    if missing:
        names = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "") for t, p, e in missing]
        raise SourceError(f"{path}: rank folder(s) missing for tp={tp} pp={pp} ep={ep}: {', '.join(names[:8])}")
    per_chunk = L // (pp * vp)
    local_experts = E // ep if E else 0
    # global name -> list of (tp rank, ep rank, source, where)
    pieces: dict[str, list[tuple[int, int, TensorSource, str]]] = {}
    iteration = None
    for (t, p, e), f in sorted(found.items()):
        tz = TorchZip(str(f), pool)
        obj = tz.load(trust=trust_pickle)
        if not isinstance(obj, dict):
            raise SourceError(f"{f} holds a {type(obj).__name__}, not a Megatron checkpoint dict")
        iteration = obj.get("iteration", iteration)
        chunks = [(0, obj["model"])] if "model" in obj else [(int(k[5:]), v) for k, v in obj.items() if re.fullmatch(r"model\d+", k)]
        if not chunks:
            raise SourceError(f"{f}: no 'model' entry")
        rel = f"{f.parent.name}/{f.name}"
        for v, sd in chunks:
            for k, val in sd.items():
                if not isinstance(val, torch.Tensor):
                    continue
                name = _global_name(k, p * per_chunk + v * (L // vp), e * local_experts)
                pieces.setdefault(name, []).append((t, e, tz.source_of(val), rel))
    gated = bool(args.get("swiglu"))
    tensors: dict[str, TensorSource] = {}
    for name, items in pieces.items():
        tensors[name] = _assemble(name, items, tp if ".experts." not in name else etp, gated, check_replicas)
    return SourceCheckpoint(
        format="megatron",
        path=str(path),
        tensors=tensors,
        world_size=len(found),
        mesh=_mesh(args),
        placements={"legacy mp_rank files": len(found)},
        notes=[f"legacy checkpoint: {len(found)} rank files, layers renumbered over pp={pp} vp={vp}"
               + (f", experts over ep={ep}" if ep > 1 else "")],
        step=iteration if isinstance(iteration, int) else None,
        files=[str(f) for f in found.values()],
        extra={"megatron_args": args, "megatron_format": "legacy"},
    )


def _global_name(local: str, layer_offset: int, expert_offset: int) -> str:
    m = re.match(r"^(decoder\.layers\.|mtp\.layers\.)(\d+)\.(.*)$", local)
    if not m:
        return local
    rest = m.group(3)
    me = re.match(r"^(mlp\.experts\.local_experts\.)(\d+)\.(.*)$", rest)
    if me:
        rest = f"{me.group(1)}{int(me.group(2)) + expert_offset}.{me.group(3)}"
    offset = layer_offset if m.group(1) == "decoder.layers." else 0
    return f"{m.group(1)}{int(m.group(2)) + offset}.{rest}"


def _assemble(name: str, items: list, tp: int, gated: bool, check_replicas: bool) -> Assembled:
    by_tp: dict[int, list] = {}
    for t, _ep, src, where in items:
        by_tp.setdefault(t, []).append((src, where))
    dtype = items[0][2].dtype
    first = items[0][2]
    if name.endswith(COLUMN_PARALLEL):
        dim = 0
    elif name.endswith(ROW_PARALLEL):
        dim = 1
    else:
        dim = None
    if dim is None or len(by_tp) == 1:
        srcs = [s for lst in by_tp.values() for s in lst]
        t = Assembled(name, tuple(first.shape), dtype, [Piece((0,) * len(first.shape), srcs[0][0], [s for s, _ in srcs[1:]], srcs[0][1])], check_replicas)
        t.validate()
        return t
    if sorted(by_tp) != list(range(tp)):
        raise SourceError(f"{name}: pieces for tensor-parallel ranks {sorted(by_tp)} of {tp}")
    local = tuple(first.shape)
    shape = list(local)
    shape[dim] = local[dim] * tp
    ps = []
    for r in range(tp):
        (src, where), *reps = by_tp[r]
        if tuple(src.shape) != local:
            raise SourceError(f"{name}: tensor-parallel piece in {where} is {list(src.shape)}, others {list(local)}")
        if gated and name.endswith("linear_fc1.weight"):
            half = local[0] // 2  # this TP piece is [gate_r; up_r]
            for part, base in ((0, 0), (1, shape[0] // 2)):
                region = ((part * half, (part + 1) * half),) + full_box(local)[1:]
                ps.append(Piece((base + r * half,) + (0,) * (len(local) - 1), Sliced(src, region),
                                [Sliced(x, region) for x, _ in reps], where))
        else:
            off = [0] * len(local)
            off[dim] = r * local[dim]
            ps.append(Piece(tuple(off), src, [x for x, _ in reps], where))
    t = Assembled(name, tuple(shape), dtype, ps, check_replicas)
    t.validate()
    return t
