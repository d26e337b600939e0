"""Reader for single-file checkpoints: Lightning ``.ckpt`` (DDP, single device) and plain ``torch.save`` state dicts.

Format facts (Lightning ``Trainer.save_checkpoint``): a ``torch.save`` dict with ``state_dict`` (the
LightningModule's ``state_dict()``, keys prefixed by its attribute path, e.g. ``model.model.layers.0...``),
``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``, ``epoch``, ``global_step`` and, with
``save_hyperparameters()``, ``hyper_parameters`` (possibly OmegaConf containers, read through inert stand-ins so no
``--trust-pickle`` is needed). Only ``state_dict`` tensors are described; optimizer tensors are never read.
A plain file holding a state dict, ``{"state_dict": ...}`` or ``{"model": ...}`` is read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import SourceError
from .base import Assembled, FilePool, Piece, ShapeOracle, SourceCheckpoint
from .torchzip import TorchZip


def _model_dict(obj: Any, path: Path) -> tuple[Mapping, str]:
    if isinstance(obj, Mapping):
        sd = obj.get("state_dict")
        if isinstance(sd, Mapping):
            return sd, "state_dict"
        sd = obj.get("model")
        if isinstance(sd, Mapping) and any(isinstance(v, torch.Tensor) for v in sd.values()):
            return sd, "model"
        if obj and any(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj, ""
    raise SourceError(f"{path} holds no state dict (looked for 'state_dict', 'model' or tensors at the top level)")


def read_single_file(
    path: Path,
    pool: FilePool,
    shape_oracle: ShapeOracle,
    trust_pickle: bool = False,
    check_replicas: bool = True,
) -> SourceCheckpoint:
    """Describe the model tensors of a single-file checkpoint (metadata only).

    Raises:
        SourceError: not a torch.save file, truncated, or no state dict inside (names the file).
        PickleRefusedError: a foreign object (unless ``trust_pickle``).
    """
    tz = TorchZip(str(path), pool)
    obj = tz.load(trust=trust_pickle)
    sd, where = _model_dict(obj, path)
    tensors = {}
    skipped = []
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            skipped.append(str(k))
            continue
        if type(v).__name__ in ("DTensor", "ShardedTensor"):
            raise SourceError(
                f"{path} holds {type(v).__name__} shards ('{k}'): it is one rank's piece of a sharded checkpoint; "
                "point at the folder holding every rank's file"
            )
        src = tz.source_of(v)
        t = Assembled(str(k), tuple(src.shape), src.dtype, [Piece((0,) * len(src.shape), src, where=path.name)], check_replicas)
        tensors[str(k)] = t
    notes = []
    if skipped:
        notes.append(f"skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:5])}")
    step = obj.get("global_step") if isinstance(obj, Mapping) else None
    return SourceCheckpoint(
        format="lightning",
        path=str(path),
        tensors=tensors,
        world_size=1,
        mesh="(single file)",
        placements={"full tensors": len(tensors)},
        notes=notes,
        step=step if isinstance(step, int) else None,
        files=[str(path)],
        extra={"entry": where},
    )
