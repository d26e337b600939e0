"""Reader for ``torch.distributed.checkpoint`` folders: plain, Lightning sharded checkpoints, accelerate FSDP.

Format facts (torch.distributed.checkpoint, ``FileSystemWriter``): ``.metadata`` is a pickled ``Metadata`` whose
``state_dict_metadata`` maps each flattened key (``model.layers.0...``; nested dicts joined with ``.``) to a
``TensorStorageMetadata`` (global size, dtype, chunks with offsets and sizes) or ``BytesStorageMetadata``, and whose
``storage_data`` maps ``MetadataIndex(fqn, chunk offset)`` to ``_StorageInfo(relative_path, offset, length)``: the
chunk is a ``torch.save`` blob at that byte range of ``__R_K.distcp``. Replicated values are saved once.

Only tensor entries that can belong to the model are described: optimizer state (``optim``/``optimizer``/
``optimizer_states`` subtrees) and byte entries are never read. Each chunk blob is parsed lazily, on its first read,
so describing a checkpoint reads ``.metadata`` and file sizes only.

Lightning writes the same format into a folder named ``epoch=E-step=S.ckpt/`` with a ``meta.pt``; model keys are
under ``state_dict.`` (ModelParallelStrategy) or ``model.`` (FSDPStrategy) followed by the LightningModule's
attribute path. accelerate writes ``checkpoint-N/pytorch_model_fsdp_0/`` with keys under ``model.``.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import SourceError, UnsupportedSourceError
from . import safepickle
from .base import Assembled, Box, FilePool, Piece, ShapeOracle, SourceCheckpoint, TensorSource
from .torchzip import TorchZip

# Top-level entries that hold optimizer or scheduler state (plain DCP, Lightning's optimizer_0, accelerate).
OPTIMIZER_ROOT = re.compile(r"^(optim|optimizer|optimizers|optimizer_states|optimizer_\d+|lr_schedulers?|scheduler)$")


@dataclass(eq=False)
class DcpChunk(TensorSource):
    """One saved chunk: a ``torch.save`` blob at ``offset``..``offset+length`` of ``path``, parsed on first read."""

    pool: FilePool
    path: str
    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    trust: bool = False
    _inner: TensorSource | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def files(self) -> set[str]:
        return {self.path}

    def identity(self) -> tuple:
        return ("dcp", self.path, self.offset)

    def _resolve(self) -> TensorSource:
        with self._lock:
            if self._inner is None:
                tz = TorchZip(self.path, self.pool, base=self.offset, length=self.length)
                obj = tz.load(trust=self.trust)
                if not isinstance(obj, torch.Tensor):
                    raise SourceError(f"{tz.where}: holds a {type(obj).__name__}, expected a tensor chunk")
                inner = tz.source_of(obj)
                if tuple(inner.shape) != self.shape or inner.dtype != self.dtype:
                    raise SourceError(
                        f"{tz.where}: chunk is {list(inner.shape)} {inner.dtype}, .metadata says {list(self.shape)} {self.dtype}"
                    )
                self._inner = inner
            return self._inner

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        self._resolve().read_into(box, out)


def read_metadata(folder: Path, trust_pickle: bool = False) -> Any:
    """The unpickled ``.metadata`` of a DCP folder (restricted unpickler).

    Raises:
        SourceError: no ``.metadata`` (the save is incomplete) or it cannot be read.
    """
    md_path = folder / ".metadata"
    if not md_path.is_file():
        parts = sorted(p.name for p in folder.glob("*.distcp"))
        if parts:
            raise SourceError(
                f"{folder} has {len(parts)} .distcp file(s) but no .metadata: the checkpoint is still being written "
                "or its save was interrupted"
            )
        raise SourceError(f"{folder}: no .metadata file (not a torch.distributed.checkpoint folder)")
    md = safepickle.loads(md_path.read_bytes(), str(md_path), trust=trust_pickle)
    if not hasattr(md, "state_dict_metadata") or not hasattr(md, "storage_data"):
        raise SourceError(f"{md_path} is not a torch.distributed.checkpoint Metadata object")
    return md


def read_dcp(
    folder: Path,
    pool: FilePool,
    shape_oracle: ShapeOracle,
    trust_pickle: bool = False,
    check_replicas: bool = True,
) -> SourceCheckpoint:
    """Describe the model tensors of a DCP folder from ``.metadata`` (no tensor data read).

    Raises:
        SourceError: missing ``.metadata``, a ``.distcp`` file it names is missing or too short, chunks that do not
            tile a tensor (all named).
        UnsupportedSourceError: chunks saved with storage transforms (compression extensions).
    """
    md = read_metadata(folder, trust_pickle)
    index: dict[tuple[str, tuple[int, ...]], Any] = {}
    for idx, info in md.storage_data.items():
        index[(idx.fqn, tuple(idx.offset or ()))] = info
    sizes: dict[str, int] = {}
    tensors: dict[str, TensorSource] = {}
    skipped: Counter = Counter()
    files: set[str] = set()
    for fqn, tmeta in md.state_dict_metadata.items():
        root = fqn.split(".", 1)[0]
        if OPTIMIZER_ROOT.match(root):
            skipped["optimizer"] += 1
            continue
        if not hasattr(tmeta, "chunks"):
            skipped["non-tensor"] += 1
            continue
        shape = tuple(int(x) for x in tmeta.size)
        dtype = tmeta.properties.dtype
        pieces = []
        for chunk in tmeta.chunks:
            off = tuple(int(x) for x in chunk.offsets)
            info = index.get((fqn, off))
            if info is None:
                raise SourceError(f"{folder / '.metadata'}: no storage entry for {fqn} chunk at {list(off)}")
            if getattr(info, "transform_descriptors", None):
                raise UnsupportedSourceError(
                    f"{fqn} in {folder}: chunk saved with storage transforms {list(info.transform_descriptors)}"
                )
            path = folder / info.relative_path
            rel = str(info.relative_path)
            if rel not in sizes:
                try:
                    sizes[rel] = os.path.getsize(path)
                except OSError:
                    raise SourceError(f"{folder / '.metadata'} names {rel}, which is missing from {folder}") from None
            if info.offset + info.length > sizes[rel]:
                raise SourceError(f"{path} is truncated: {fqn} needs bytes up to {info.offset + info.length}, the file has {sizes[rel]}")
            files.add(str(path))
            src = DcpChunk(pool, str(path), int(info.offset), int(info.length), tuple(int(x) for x in chunk.sizes), dtype, trust_pickle)
            pieces.append(Piece(off, src, where=rel))
        t = Assembled(fqn, shape, dtype, pieces, check_replicas)
        t.validate()
        tensors[fqn] = t
    notes = []
    if skipped:
        notes.append("not read: " + ", ".join(f"{n} {k} entries" for k, n in skipped.items()))
    ranks = {p.name.split("_")[2] for p in map(Path, files) if p.name.startswith("__")}
    world = len(ranks) or 1
    kind, extra = "torch.distributed.checkpoint", {}
    if (folder / "meta.pt").is_file():
        kind = "Lightning sharded checkpoint"
    elif folder.name.startswith("pytorch_model_fsdp"):
        kind = "accelerate FSDP checkpoint"
    return SourceCheckpoint(
        format="dcp",
        path=str(folder),
        tensors=tensors,
        world_size=world,
        mesh=f"({kind}, {world} writer ranks)",
        placements=_chunk_summary(tensors),
        notes=notes,
        files=sorted(files),
        extra=extra,
    )


def _chunk_summary(tensors: dict[str, TensorSource]) -> dict[str, int]:
    c: Counter = Counter()
    for t in tensors.values():
        n = len(getattr(t, "pieces", [])) or 1
        c[f"{n} chunk{'s' if n != 1 else ''}"] += 1
    return dict(c)
