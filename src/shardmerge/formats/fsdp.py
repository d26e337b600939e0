"""Reader for verl FSDP checkpoints: one ``model_world_size_{W}_rank_{R}.pt`` per rank.

Layout facts (verl ``FSDPCheckpointManager``): each rank ``torch.save``s its ``model.state_dict()``: DTensors under
FSDP2 and under FSDP1 built with a device mesh, plain tensors in older files and for W=1; ``fsdp_config.json`` holds
``{"FSDP_version": ..., "world_size": W}``; ``huggingface/`` holds the HF config and tokenizer; LoRA runs add
``lora_train_meta.json``.

DTensor pieces: each rank file pickles the rank's own device mesh (with its coordinate) and placements, so
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` gives the box the local tensor covers
(``_StridedShard`` and uneven last shards included) without a process group. Pieces at the same offset in several
files are replicas (replicated mesh dims such as HSDP's, and non-TP parameters under FSDP+TP): one is kept (the one
at coordinate 0 on replicated mesh dims) and the others are compared with it while reading.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import SourceError, UnsupportedSourceError
from .base import Assembled, FilePool, Piece, ShapeOracle, SourceCheckpoint, classify_plain
from .torchzip import TorchZip

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


def rank_files(folder: Path) -> list[tuple[int, int, Path]]:
    """``[(world_size, rank, path), ...]`` of the rank files directly in ``folder``."""
    out = []
    if folder.is_dir():
        for p in folder.iterdir():
            m = RANK_FILE.match(p.name)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(out)


def world_size_of(folder: Path) -> int:
    """World size from ``fsdp_config.json``, else from the rank file names; checks they agree and nothing is missing.

    Raises:
        SourceError: no rank files, several world sizes mixed, a contradiction with ``fsdp_config.json``, or a
            missing rank file (all named).
    """
    files = rank_files(folder)
    if not files:
        raise SourceError(f"{folder}: no model_world_size_W_rank_R.pt files")
    sizes = sorted({w for w, _, _ in files})
    if len(sizes) > 1:
        examples = ", ".join(next(p.name for w2, _, p in files if w2 == w) for w in sizes)
        raise SourceError(f"{folder}: rank files of several world sizes {sizes} are mixed ({examples}); remove the stale ones")
    world = sizes[0]
    cfg_path = folder / "fsdp_config.json"
    if cfg_path.is_file():
        try:
            data = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{cfg_path} is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise SourceError(f"{cfg_path} holds a JSON {type(data).__name__}, expected an object with world_size")
        declared = data.get("world_size")
        if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int) or declared < 1):
            raise SourceError(f"{cfg_path}: world_size is {declared!r}, expected a positive integer")
        if declared is not None and declared != world:
            raise SourceError(
                f"{cfg_path} says world_size={declared} but the rank files are for world size {world} "
                f"({files[0][2].name})"
            )
    have = {r for _, r, _ in files}
    missing = [f"model_world_size_{world}_rank_{r}.pt" for r in range(world) if r not in have]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise SourceError(f"{folder}: rank file(s) missing for world size {world}: {shown}")
    extra = sorted(r for r in have if r >= world)
    if extra:
        raise SourceError(f"{folder}: rank file for rank {extra[0]} but world size is {world}")
    return world


def read_fsdp(
    folder: Path,
    pool: FilePool,
    shape_oracle: ShapeOracle,
    trust_pickle: bool = False,
    check_replicas: bool = True,
) -> SourceCheckpoint:
    """Describe every tensor of a verl FSDP actor/critic folder from metadata only (no tensor data read).

    Args:
        folder: the folder holding the rank files.
        pool: file pool the returned sources read through.
        shape_oracle: training name -> expected global shape; consulted only for plain (non-DTensor) tensors.

    Returns:
        a :class:`SourceCheckpoint` with one :class:`Assembled` tensor per state-dict key.

    Raises:
        SourceError: missing/truncated/unreadable rank files, inconsistent keys or shapes (names the files).
        PickleRefusedError: a foreign object in a rank file (unless ``trust_pickle``).
        UnsupportedSourceError: ``Partial`` placements or ShardedTensor values (FSDP1 without a device mesh).
    """
    import torch.distributed.tensor  # noqa: F401 - registers DTensor for unpickling

    world = world_size_of(folder)
    paths = [folder / f"model_world_size_{world}_rank_{r}.pt" for r in range(world)]

    def load(path: Path) -> tuple[TorchZip, Mapping[str, Any]]:
        tz = TorchZip(str(path), pool)
        obj = tz.load(trust=trust_pickle)
        if not isinstance(obj, Mapping):
            raise SourceError(f"{path} holds a {type(obj).__name__}, not a state dict")
        return tz, obj

    with ThreadPoolExecutor(max_workers=min(8, world)) as ex:
        loaded = list(ex.map(load, paths))

    keys0 = list(loaded[0][1].keys())
    set0 = set(keys0)
    for (_tz, sd), path in zip(loaded[1:], paths[1:]):
        if set(sd.keys()) != set0:
            only_here = sorted(set(sd.keys()) - set0)
            only_0 = sorted(set0 - set(sd.keys()))
            what = f"'{only_here[0]}' is only in {path.name}" if only_here else f"'{only_0[0]}' is missing from {path.name}"
            raise SourceError(f"{folder}: rank files hold different keys: {what}")


    tensors: dict[str, Any] = {}
    placements: Counter = Counter()
    notes: list[str] = []
    meshes: dict[str, int] = {}
    skipped: list[str] = []
    replicas_kept = 0
    plain_keys: list[str] = []
    for key in keys0:
        values = [(tz, sd[key], path) for (tz, sd), path in zip(loaded, paths)]
        kinds = {_kind(v) for _, v, _ in values}
        if kinds == {"other"}:
            skipped.append(key)
            continue
        if len(kinds) > 1:
            raise SourceError(f"{key}: some rank files hold a DTensor and others a plain tensor ({folder})")
        kind = kinds.pop()
        if kind == "sharded_tensor":
            raise UnsupportedSourceError(
                f"{paths[0]}: '{key}' is a ShardedTensor (FSDP1 without a device mesh); its pieces cannot be read "
                "without the process group; save with a device mesh (DTensor) or a full state dict"
            )
        if kind == "dtensor":
            t, desc, n_rep = _assemble_dtensor(key, values, check_replicas)
            tensors[key] = t
            placements[desc[1]] += 1
            meshes[desc[0]] = desc[2]
            replicas_kept += n_rep
        else:
            plain_keys.append(key)
    if plain_keys:
        for key in plain_keys:
            copies = [(p.name, tz.source_of(sd[key])) for (tz, sd), p in zip(loaded, paths)]
            expected = None if world == 1 else shape_oracle(key)
            t, how = classify_plain(key, copies, expected, check_replicas)
            tensors[key] = t
            placements[f"plain {how}"] += 1
        meshes.setdefault(f"(world_size={world}, plain tensors)", 0)
    if skipped:
        notes.append(f"skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:5])}")
    if replicas_kept:
        notes.append(
            f"{replicas_kept} replicated pieces found in several rank files: one copy kept"
            + (", copies compared while reading" if check_replicas else "")
        )
    extra: dict[str, Any] = {}
    lora_meta = folder / "lora_train_meta.json"
    if lora_meta.is_file():
        try:
            extra["lora_train_meta"] = json.loads(lora_meta.read_text())
        except json.JSONDecodeError as e:
            raise SourceError(f"{lora_meta} is not valid JSON ({e})") from None
    return SourceCheckpoint(
        format="fsdp",
        path=str(folder),
        tensors=tensors,
        world_size=world,
        # The widest mesh describes the layout (FSDP+TP: (dp, tp); its 1-D dp sub-mesh holds the non-TP tensors).
        mesh=max(meshes, key=lambda k: meshes[k]) if meshes else None,
        placements=dict(placements),
        notes=notes,
        files=[str(p) for p in paths],
        extra=extra,
    )


def _kind(v: Any) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return "dtensor"
    if type(v).__name__ == "ShardedTensor":
        return "sharded_tensor"
    if isinstance(v, torch.Tensor):
        return "plain"
    return "other"


def describe_mesh(mesh: Any) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")"


def _assemble_dtensor(key: str, values: list, check_replicas: bool) -> tuple[Assembled, tuple[str, str], int]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Partial, Replicate

    first = values[0][1]
    gshape = tuple(first.shape)
    dtype = first._local_tensor.dtype
    groups: dict[tuple, list] = defaultdict(list)
    for rank, (tz, dt, path) in enumerate(values):
        spec = dt._spec
        if tuple(dt.shape) != gshape:
            raise SourceError(f"{key}: global shape {list(dt.shape)} in {path.name} differs from {list(gshape)} in {values[0][2].name}")
        if any(isinstance(p, Partial) for p in spec.placements):
            raise UnsupportedSourceError(f"{key} in {path}: Partial placement (unreduced values) cannot be merged")
        local = dt._local_tensor
        if local.dtype != dtype:
            raise SourceError(f"{key}: dtype {local.dtype} in {path.name} differs from {dtype} in {values[0][2].name}")
        lshape, offset = compute_local_shape_and_global_offset(gshape, spec.mesh, spec.placements)
        if tuple(lshape) != tuple(local.shape):
            raise SourceError(
                f"{key} in {path}: local shape {list(local.shape)} does not match placements {tuple(spec.placements)} "
                f"of global shape {list(gshape)} (expected {list(lshape)})"
            )
        coord = spec.mesh.get_coordinate() or ()
        replicated_dims = [i for i, p in enumerate(spec.placements) if isinstance(p, Replicate)]
        order = (sum(coord[i] for i in replicated_dims if i < len(coord)), rank)
        groups[(tuple(offset), tuple(lshape))].append((order, tz.source_of(local), path.name))
    pieces = []
    n_rep = 0
    for (offset, lshape), members in groups.items():
        if 0 in lshape:
            continue
        members.sort(key=lambda m: m[0])
        (_, src, where), rest = members[0], members[1:]
        n_rep += len(rest)
        pieces.append(Piece(offset, src, [m[1] for m in rest], where=where))
    t = Assembled(key, gshape, dtype, pieces, check_replicas)
    t.validate()
    spec0 = first._spec
    return t, (describe_mesh(spec0.mesh), str(tuple(spec0.placements)), spec0.mesh.ndim), n_rep
