"""Lazy tensors read in boxes: the common currency between readers, converters and the writer.

A :class:`TensorSource` describes one logical tensor (global shape, dtype) and delivers any *box* of it (a
hyper-rectangle given as ``((start, stop), ...)`` per dimension) as a contiguous CPU tensor. Nothing is read until a
box is asked for, so the writer can stream a tensor of any size through a bounded buffer: it asks for row blocks.

Readers build :class:`StorageSlice` leaves (bytes at a known offset of a file) and :class:`Assembled` tensors (a
global tensor made of pieces at offsets, e.g. DTensor shards); converters build :class:`Sliced` views (Megatron QKV
split, fused expert split, vocabulary trim) on top of them.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from ..errors import SourceError

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


class FilePool:
    """Read-only file descriptors shared by all readers of one merge; ``pread`` by offset, thread-safe.

    Reading by offset (rather than ``torch.load(mmap=True)``) keeps resident memory bounded by the buffers in
    flight: pages touched through a mapping stay resident until the mapping goes away.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise SourceError(f"cannot open {path}: {e.strerror}") from None
                self._fds[path] = fd
            return fd

    def pread_into(self, path: str, buf: torch.Tensor, offset: int) -> None:
        """Fill the uint8 tensor ``buf`` with the bytes of ``path`` at ``offset``.

        Raises:
            SourceError: the file ends before ``offset + len(buf)`` (truncated file).
        """
        fd = self.fd(path)
        view = memoryview(buf.numpy()).cast("B")
        done, total = 0, len(view)
        while done < total:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise SourceError(
                    f"{path} is truncated: needed bytes {offset}..{offset + total}, file ends at {offset + done}"
                )
            done += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()


class TensorSource:
    """A logical tensor readable in boxes.

    Attributes:
        shape: global shape (elements per dimension).
        dtype: torch dtype of the stored values.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def read(self, box: Box) -> torch.Tensor:
        """Return the values inside ``box`` as a contiguous CPU tensor of shape ``box_shape(box)``."""
        out = torch.empty(box_shape(box), dtype=self.dtype)
        self.read_into(box, out)
        return out

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        """Write the values inside ``box`` into ``out`` (shape ``box_shape(box)``, this dtype, any strides).

        The writer calls this with reused buffers, so no allocation happens per block in the common case.
        """
        raise NotImplementedError

    def identity(self) -> tuple | None:
        """A hashable that equals another source's iff both read the very same stored bytes (tie detection)."""
        return None

    def files(self) -> set[str]:
        """Files this tensor's bytes come from (for error messages)."""
        return set()


@dataclass(eq=False)
class StorageSlice(TensorSource):
    """A strided view into a storage stored raw at ``byte_offset`` of ``path`` (torch zip record, DCP item).

    ``storage_offset`` and ``stride`` are in elements, as in ``torch.Tensor.as_strided``.
    """

    pool: FilePool
    path: str
    byte_offset: int
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_nbytes: int = -1

    def identity(self) -> tuple:
        return (self.path, self.byte_offset, self.storage_offset, self.shape, self.stride, self.dtype)

    def files(self) -> set[str]:
        return {self.path}

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        shape = box_shape(box)
        count = math.prod(shape)
        if count == 0:
            return
        item = self.dtype.itemsize
        first = self.storage_offset + sum(a * s for (a, _), s in zip(box, self.stride))
        last = self.storage_offset + sum((b - 1) * s for (_, b), s in zip(box, self.stride))
        span = last - first + 1
        dense = span == count and _is_contiguous(shape, self.stride)
        if dense and out.is_contiguous():
            # The common case: the box is one byte range of the file; read it straight into the caller's buffer.
            self.pool.pread_into(self.path, out.view(-1).view(torch.uint8), self.byte_offset + first * item)
            return
        if span > 2 * count + (1 << 18) and shape[0] > 1:
            # A narrow box across long rows: read index by index rather than the whole span.
            for i in range(box[0][0], box[0][1]):
                self.read_into(((i, i + 1),) + box[1:], out[i - box[0][0] : i - box[0][0] + 1])
            return
        buf = torch.empty(span * item, dtype=torch.uint8)
        self.pool.pread_into(self.path, buf, self.byte_offset + first * item)
        flat = buf.view(self.dtype)
        out.copy_(flat.view(shape) if dense else flat.as_strided(shape, self.stride, 0))


def _is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expected = contiguous_strides(shape)
    return all(n <= 1 or s == e for n, s, e in zip(shape, stride, expected))


@dataclass(eq=False)
class Piece:
    """One box of a global tensor: ``offset`` + ``source.shape``; ``replicas`` hold the same values elsewhere."""

    offset: tuple[int, ...]
    source: TensorSource
    replicas: list[TensorSource] = field(default_factory=list)
    where: str = ""

    @property
    def box(self) -> Box:
        return tuple((o, o + n) for o, n in zip(self.offset, self.source.shape))


class ReplicaMismatch(SourceError):
    pass


@dataclass(eq=False)
class Assembled(TensorSource):
    """A global tensor made of non-overlapping pieces that cover it exactly (checked by :meth:`validate`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    check_replicas: bool = True

    def validate(self) -> None:
        """Raise :class:`SourceError` unless the pieces tile the global shape exactly (no gap, no overlap)."""
        total = 0
        for p in self.pieces:
            if len(p.offset) != len(self.shape):
                raise SourceError(f"{self.name}: piece in {p.where} has rank {len(p.offset)}, tensor has {len(self.shape)}")
            for (a, b), n in zip(p.box, self.shape):
                if a < 0 or b > n:
                    raise SourceError(f"{self.name}: piece {p.box} in {p.where} lies outside the global shape {list(self.shape)}")
            if p.source.dtype != self.dtype:
                raise SourceError(f"{self.name}: piece in {p.where} is {p.source.dtype}, others are {self.dtype}")
            total += p.source.numel
        boxes = [p.box for p in self.pieces]
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                if intersect(boxes[i], boxes[j]) is not None:
                    raise SourceError(
                        f"{self.name}: pieces in {self.pieces[i].where} and {self.pieces[j].where} overlap "
                        f"({list(boxes[i])} and {list(boxes[j])})"
                    )
        if total != math.prod(self.shape):
            have = sorted({p.where for p in self.pieces})
            raise SourceError(
                f"{self.name}: the pieces found ({', '.join(have) or 'none'}) hold {total} of "
                f"{math.prod(self.shape)} elements of shape {list(self.shape)}: a rank file is missing or shards are incomplete"
            )

    def files(self) -> set[str]:
        out: set[str] = set()
        for p in self.pieces:
            out |= p.source.files()
        return out

    def identity(self) -> tuple | None:
        ids = tuple((p.offset, p.source.identity()) for p in self.pieces)
        return None if any(i is None for _, i in ids) else ids

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        for p in self.pieces:
            sub = intersect(box, p.box)
            if sub is None:
                continue
            dst = out if sub == box else out[tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(sub, box))]
            local = tuple((a - o, b - o) for (a, b), o in zip(sub, p.offset))
            p.source.read_into(local, dst)
            if self.check_replicas:
                for r in p.replicas:
                    if not _bitwise_equal(dst, r.read(local)):
                        raise ReplicaMismatch(
                            f"{self.name}: replicas differ in box {list(sub)}: {p.where} vs {', '.join(sorted(r.files()))}; "
                            "the checkpoint is inconsistent (--no-check-replicas / check_replicas=False keeps the first copy)"
                        )


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal treats NaN != NaN; replicas holding the same NaN bits are equal copies.
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ia = a.contiguous().view(torch.uint8)
    ib = b.contiguous().view(torch.uint8)
    return torch.equal(ia, ib)


@dataclass(eq=False)
class Sliced(TensorSource):
    """A box of another source, with the dimensions listed in ``squeeze`` dropped (each of extent 1).

    Example: expert ``e``'s gate rows of a fused ``[E, 2I, H]`` tensor are
    ``Sliced(src, ((e, e+1), (0, I), (0, H)), squeeze=(0,))`` of shape ``[I, H]``.
    """

    base: TensorSource
    region: Box
    squeeze: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.dtype = self.base.dtype
        shape = box_shape(self.region)
        for d in self.squeeze:
            if shape[d] != 1:
                raise ValueError(f"cannot squeeze dim {d} of extent {shape[d]}")
        self.shape = tuple(n for i, n in enumerate(shape) if i not in self.squeeze)

    def files(self) -> set[str]:
        return self.base.files()

    def identity(self) -> tuple | None:
        inner = self.base.identity()
        return None if inner is None else ("slice", inner, self.region, self.squeeze)

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        it = iter(box)
        full = []
        for i, (a, _) in enumerate(self.region):
            if i in self.squeeze:
                full.append((a, a + 1))
            else:
                s, e = next(it)
                full.append((a + s, a + e))
        view = out
        for d in sorted(self.squeeze):
            view = view.unsqueeze(d)
        self.base.read_into(tuple(full), view)


@dataclass(eq=False)
class Unsqueezed(TensorSource):
    """``base`` with a new dimension of extent 1 at ``dim`` (a per-expert tensor as one slot of a stacked one)."""

    base: TensorSource
    dim: int = 0

    def __post_init__(self) -> None:
        self.dtype = self.base.dtype
        shape = list(self.base.shape)
        shape.insert(self.dim, 1)
        self.shape = tuple(shape)

    def files(self) -> set[str]:
        return self.base.files()

    def identity(self) -> tuple | None:
        inner = self.base.identity()
        return None if inner is None else ("unsqueeze", inner, self.dim)

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        inner = box[: self.dim] + box[self.dim + 1 :]
        self.base.read_into(inner, out.squeeze(self.dim))


@dataclass(eq=False)
class InMemory(TensorSource):
    """A small tensor already in memory (e.g. values decoded from a pickle)."""

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        self.shape = tuple(self.tensor.shape)
        self.dtype = self.tensor.dtype

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        out.copy_(self.tensor[tuple(slice(a, b) for a, b in box)])


@dataclass
class SourceCheckpoint:
    """What a reader found: tensors by training name plus facts for the report.

    Attributes:
        format: reader family name (``fsdp``, ``dcp``, ``lightning``, ``megatron``).
        path: the folder or file read.
        tensors: training name -> :class:`TensorSource` with the global shape.
        world_size: number of ranks that wrote the checkpoint (1 for single-file checkpoints).
        mesh: human-readable device-mesh description, e.g. ``"(ddp=2, fsdp=2)"``.
        placements: placement summary -> number of tensors, e.g. ``{"(Replicate(), Shard(dim=0))": 290}``.
        notes: decisions worth telling the user (replicas kept, entries skipped).
        step: training step if the layout records it.
        extra: format-specific facts (e.g. LoRA metadata).
    """

    format: str
    path: str
    tensors: dict[str, TensorSource]
    world_size: int = 1
    mesh: str | None = None
    placements: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    step: int | None = None
    files: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


ShapeOracle = Callable[[str], "tuple[int, ...] | None"]


def classify_plain(
    name: str,
    copies: Sequence[tuple[str, TensorSource]],
    expected: tuple[int, ...] | None,
    check_replicas: bool,
) -> tuple[Assembled, str]:
    """Turn per-rank plain (non-DTensor) values of one key into an :class:`Assembled` tensor, by shape only.

    ``copies`` is ``[(file, source), ...]`` in rank order. A local shape equal to ``expected`` is a replica (one kept,
    the others compared when read); dim-0 sizes that add up to ``expected`` are Shard(0) pieces in rank order.

    Returns:
        the tensor and the classification (``"replicated"`` or ``"Shard(0)"``).

    Raises:
        SourceError: shapes fit neither reading (names the key, the shapes and the files).
    """
    shapes = [tuple(src.shape) for _, src in copies]
    dtype = copies[0][1].dtype
    if expected is None:
        if len(set(shapes)) == 1 and len(copies) == 1:
            expected = shapes[0]
        else:
            raise SourceError(
                f"{name}: plain tensors of shapes {shapes} in {copies[0][0]} ... and no expected shape from the HF "
                "config to classify them (is the key unknown to the model?)"
            )
    expected = tuple(expected)
    if all(s == expected for s in shapes):
        first = Piece((0,) * len(expected), copies[0][1], [src for _, src in copies[1:]], where=copies[0][0])
        t = Assembled(name, expected, dtype, [first], check_replicas)
        t.validate()
        return t, "replicated"
    if (
        expected
        and all(len(s) == len(expected) and s[1:] == expected[1:] for s in shapes)
        and sum(s[0] for s in shapes) == expected[0]
    ):
        pieces, off = [], 0
        for f, src in copies:
            if src.shape[0]:
                pieces.append(Piece((off,) + (0,) * (len(expected) - 1), src, where=f))
            off += src.shape[0]
        t = Assembled(name, expected, dtype, pieces, check_replicas)
        t.validate()
        return t, "Shard(0)"
    raise SourceError(
        f"{name}: per-rank shapes {shapes} (first in {copies[0][0]}) are neither replicas nor dim-0 shards of the "
        f"expected shape {list(expected)}"
    )


def iter_row_blocks(shape: Sequence[int], itemsize: int, block_bytes: int) -> Iterable[Box]:
    """Split a tensor into boxes of whole dim-0 rows of about ``block_bytes`` each (at least one row)."""
    if len(shape) == 0:
        yield ()
        return
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, block_bytes // max(row, 1))
    rest = tuple((0, n) for n in shape[1:])
    for start in range(0, shape[0], rows):
        yield ((start, min(shape[0], start + rows)),) + rest
