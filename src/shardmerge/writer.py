"""The streaming safetensors writer: planned shards, bounded buffers, atomic publish.

Why our own writer: ``safetensors.torch.save_file`` needs every tensor of a file in memory at once. The safetensors
format is simple enough to plan ahead: an 8-byte little-endian header length N, N bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` plus ``"__metadata__"``, padded with spaces to a
multiple of 8), then the tensor bytes back to back, row-major, little-endian. So every output file's header is
computed from metadata, the file is sized up front, and row blocks of every tensor are written at their offsets by
several threads, each block read, assembled and cast in a buffer of bounded size.

Assignment of tensors to ``model-0000K-of-0000N.safetensors`` files is huggingface_hub's
``split_torch_state_dict_into_shards`` (the same as ``save_pretrained``), fed meta tensors.

Output directories are built under a temporary sibling ``.<target>.partial-<pid>`` and renamed into place only
when complete (see :class:`Staging`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import struct
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from .errors import DiskSpaceError, DtypeError, ShardMergeError, TargetError
from .formats.base import TensorSource, iter_row_blocks

log = logging.getLogger("shardmerge")

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}

MANIFEST = "shardmerge.json"
OWNER_FILE = ".shardmerge-owner"


@dataclass(eq=False)
class OutTensor:
    """One tensor to write: HF ``name``, lazy ``source`` and output ``dtype``."""

    name: str
    source: TensorSource
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class PlannedFile:
    """One output file: its name, tensors with byte ranges relative to the data section, and its header."""

    name: str
    entries: list[tuple[OutTensor, int, int]]
    header: bytes

    @property
    def data_start(self) -> int:
        return 8 + len(self.header)

    @property
    def size(self) -> int:
        return self.data_start + (self.entries[-1][2] if self.entries else 0)


def plan_files(tensors: list[OutTensor], max_shard_bytes: int, pattern: str = "model{suffix}.safetensors") -> list[PlannedFile]:
    """Assign tensors to files under ``max_shard_bytes`` (bytes of tensor data per file) and build each header.

    Raises:
        ShardMergeError: a dtype safetensors cannot store.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    if not tensors:
        return []
    by_name = {t.name: t for t in tensors}
    metas = {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors}
    split = split_torch_state_dict_into_shards(metas, filename_pattern=pattern, max_shard_size=max_shard_bytes)
    files = []
    for fname, names in split.filename_to_tensors.items():
        # Widest items first so every tensor's data starts aligned to its item size.
        ordered = sorted((by_name[n] for n in names), key=lambda t: -t.dtype.itemsize)
        entries, off, header = [], 0, {"__metadata__": {"format": "pt"}}
        for t in ordered:
            if t.dtype not in SAFETENSORS_DTYPES:
                raise ShardMergeError(f"{t.name}: dtype {t.dtype} cannot be stored in safetensors")
            entries.append((t, off, off + t.nbytes))
            header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
            off += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        files.append(PlannedFile(fname, entries, raw))
    return files


def index_json(files: list[PlannedFile]) -> dict:
    """``model.safetensors.index.json`` content: ``total_size`` in bytes of tensor data, ``total_parameters``."""
    weight_map = {t.name: f.name for f in files for t, _, _ in f.entries}
    total = sum(t.nbytes for f in files for t, _, _ in f.entries)
    params = sum(math.prod(t.shape) for f in files for t, _, _ in f.entries)
    return {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


@dataclass
class CastStats:
    """Counts gathered while casting: non-finite values passed through, per tensor name."""

    nonfinite: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def check_cast(name: str, src: torch.Tensor, out: torch.Tensor, stats: CastStats) -> None:
    """Check a cast block: count non-finite source values; refuse finite values that overflowed.

    ``torch.aminmax`` (one fast pass, NaN-propagating) proves the common all-finite case; only blocks holding
    non-finite output values are examined element-wise.

    Raises:
        DtypeError: a finite source value became ±inf in ``out.dtype`` (e.g. beyond float16's 65504).
    """
    if not out.dtype.is_floating_point or out.numel() == 0:
        return
    lo, hi = torch.aminmax(out)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return
    src_bad = ~torch.isfinite(src) if src.dtype.is_floating_point else torch.zeros(src.shape, dtype=torch.bool)
    overflow = int((~torch.isfinite(out) & ~src_bad).sum())
    if overflow:
        finite = src[~src_bad]
        peak = float(finite.abs().max()) if finite.numel() else float("nan")
        raise DtypeError(
            f"{name}: {overflow} finite value(s) (largest |x| = {peak:.6g}) exceed the range of "
            f"{str(out.dtype).replace('torch.', '')}; choose --dtype bfloat16, float32 or source"
        )
    with stats.lock:
        stats.nonfinite[name] = stats.nonfinite.get(name, 0) + int(src_bad.sum())


def _pwrite_all(fd: int, data: torch.Tensor, offset: int) -> None:
    view = memoryview(data.reshape(-1).view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError("short write")
        done += n


def write_files(
    files: list[PlannedFile],
    folder: Path,
    workers: int,
    block_bytes: int,
    stats: CastStats,
    progress: Callable[[int], None] | None = None,
    device: str = "cpu",
    cancelled: Callable[[], bool] | None = None,
) -> None:
    """Write every planned file into ``folder``, streaming row blocks of about ``block_bytes`` source bytes.

    ``workers`` threads each own a reused source buffer and cast buffer (no per-block allocation): a block is read
    from its sources straight into the buffer, cast (on ``device``), checked and written at its offset with
    ``pwrite``. Files are not pre-sized with ``ftruncate``: on ext4, writing into a truncated (sparse) file ran
    about 10x slower than letting the writes extend it. ``cancelled()`` is polled between blocks. Durability is
    :meth:`Staging.publish`'s job (it fsyncs every file of the folder once, before the rename).

    Raises:
        whatever a source raises (:class:`SourceError`, ...), :class:`DtypeError`, ``OSError`` (e.g. ENOSPC).
    """
    fds: list[int] = []
    try:
        jobs = []
        for f in files:
            fd = os.open(folder / f.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
            fds.append(fd)
            os.pwrite(fd, struct.pack("<Q", len(f.header)) + f.header, 0)
            for t, begin, _ in f.entries:
                jobs.append((fd, f.data_start + begin, t))
        with _Writeback() as wb:
            _run_blocks(jobs, workers, block_bytes, stats, progress, device, cancelled, wb)
        for fd, f in zip(fds, files):
            os.ftruncate(fd, f.size)  # no-op unless the file ends with empty tensors
    finally:
        for fd in fds:
            os.close(fd)


class _Writeback:
    """Starts writeback of each output file every ``step`` bytes in a background thread, so that the final
    fsync (needed before the atomic rename) finds little left to flush: about 0.15 s saved per GB here."""

    def __init__(self, step: int = 256 << 20):
        self.step = step
        self.pending: dict[int, int] = {}
        self.ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardmerge-sync")

    def wrote(self, fd: int, n: int) -> None:
        total = self.pending.get(fd, 0) + n
        if total >= self.step:
            self.ex.submit(_fdatasync_quiet, fd)
            total = 0
        self.pending[fd] = total

    def __enter__(self) -> "_Writeback":
        return self

    def __exit__(self, *exc) -> bool:
        self.ex.shutdown(wait=True)
        return False


def _fdatasync_quiet(fd: int) -> None:
    try:
        os.fdatasync(fd)
    except OSError:
        pass  # the final fsync reports real errors


class WriteCancelled(Exception):
    """Raised inside :func:`write_files` when ``cancelled()`` turned true."""


def _blocks(jobs, block_bytes: int) -> Iterable[tuple]:
    for fd, base, t in jobs:
        row_out = math.prod(t.shape[1:]) * t.dtype.itemsize if t.shape else t.dtype.itemsize
        for box in iter_row_blocks(t.shape, t.source.dtype.itemsize, block_bytes):
            yield fd, (base + box[0][0] * row_out) if box else base, t, box


class _Scratch(threading.local):
    """Per-thread reusable byte buffers (fresh large allocations cost a page fault per page)."""

    def get(self, slot: str, nbytes: int) -> torch.Tensor:
        buf = getattr(self, slot, None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            setattr(self, slot, buf)
        return buf[:nbytes]


def _run_blocks(jobs, workers: int, block_bytes: int, stats: CastStats, progress, device: str, cancelled, wb: _Writeback) -> None:
    scratch = _Scratch()

    def one(fd: int, offset: int, t: OutTensor, box) -> int:
        shape = tuple(b - a for a, b in box)
        n = math.prod(shape)
        src_dtype = t.source.dtype
        src = scratch.get("src", n * src_dtype.itemsize).view(src_dtype).view(shape)
        t.source.read_into(box, src)
        if device != "cpu":
            on_dev = src.to(device)
            out_dev = on_dev.to(t.dtype)
            check_cast(t.name, on_dev, out_dev, stats)
            out = scratch.get("dst", n * t.dtype.itemsize).view(t.dtype).view(shape)
            out.copy_(out_dev)
        elif t.dtype == src_dtype:
            out = src
        else:
            out = scratch.get("dst", n * t.dtype.itemsize).view(t.dtype).view(shape)
            out.copy_(src)
            check_cast(t.name, src, out, stats)
        _pwrite_all(fd, out, offset)
        return fd, n * t.dtype.itemsize

    def report(result: tuple[int, int]) -> None:
        fd, n = result
        wb.wrote(fd, n)
        if progress:
            progress(n)
        if cancelled is not None and cancelled():
            raise WriteCancelled()

    if workers <= 1:
        for args in _blocks(jobs, block_bytes):
            report(one(*args))
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardmerge-io") as ex:
        pending: set = set()
        try:
            for args in _blocks(jobs, block_bytes):
                if len(pending) >= 2 * workers:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        report(fut.result())
                pending.add(ex.submit(one, *args))
            for fut in pending:
                report(fut.result())
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Staging:
    """The life of one output directory: temporary sibling, cleanup, atomic publish.

    * the output is built in ``<parent>/.<name>.partial-<pid>`` holding an owner file (host, pid);
    * on entry, temporary siblings of dead processes on this host are removed; one of a live process (or of
      another host) makes this merge refuse, since two writers would race;
    * :meth:`publish` fsyncs, removes the owner file, renames the folder onto the target (a non-empty target is
      moved aside first, only with ``overwrite``) and fsyncs the parent;
    * on any exception (SIGINT/SIGTERM included, see :func:`terminate_as_exception`) the temporary folder is removed.

    A complete output always holds the manifest ``shardmerge.json``, written last.
    """

    def __init__(self, target: Path, overwrite: bool = False, protected: Iterable[Path] = ()):
        # A symlinked target (or parent) means the place it points to: the folder is built and renamed there.
        self.target = Path(os.path.realpath(target))
        self.overwrite = overwrite
        self.protected = [Path(os.path.realpath(p)) for p in protected]
        self.tmp = self.target.parent / f".{self.target.name}.partial-{os.getpid()}"
        self.published = False

    def check_target(self) -> None:
        """Raise :class:`TargetError` for a target that overlaps the source or exists without ``overwrite``."""
        t = self.target
        for p in self.protected:
            if t == p or p in t.parents or t in p.parents:
                raise TargetError(f"target {t} overlaps the source {p}; choose a folder outside the checkpoint")
        try:
            if t.exists():
                if not t.is_dir():
                    raise TargetError(f"target {t} exists and is not a directory")
                if any(t.iterdir()) and not self.overwrite:
                    raise TargetError(f"target {t} exists and is not empty; pass --overwrite to replace it")
        except OSError as e:
            raise TargetError(f"cannot inspect target {t} ({e.strerror or e})") from None

    def __enter__(self) -> "Staging":
        self.check_target()
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._clean_stale()
            try:
                self.tmp.mkdir()
            except FileExistsError:
                shutil.rmtree(self.tmp)
                self.tmp.mkdir()
            (self.tmp / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise TargetError(
                f"cannot write in {parent} ({e.strerror or e}); choose a writable --target-dir"
            ) from None
        busy = self._live_siblings()
        if busy:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise TargetError(f"target {self.target} is being written by another process ({busy[0]})")
        return self

    def _siblings(self) -> list[Path]:
        prefix = f".{self.target.name}.partial-"
        return [p for p in self.target.parent.iterdir() if p.name.startswith(prefix) and p != self.tmp]

    def _owner(self, p: Path) -> tuple[str | None, int | None]:
        try:
            info = json.loads((p / OWNER_FILE).read_text())
            return info.get("host"), int(info.get("pid"))
        except (OSError, ValueError, TypeError):
            suffix = p.name.rsplit("-", 1)[-1]
            return None, int(suffix) if suffix.isdigit() else None

    def _clean_stale(self) -> None:
        me = socket.gethostname()
        for p in self._siblings():
            host, pid = self._owner(p)
            if (host in (None, me)) and (pid is None or not _pid_alive(pid) or pid == os.getpid()):
                log.info("removing stale temporary folder %s (process %s is gone)", p, pid)
                shutil.rmtree(p, ignore_errors=True)

    def _live_siblings(self) -> list[str]:
        me = socket.gethostname()
        out = []
        for p in self._siblings():
            host, pid = self._owner(p)
            if host not in (None, me):
                out.append(f"{p.name}, host {host} pid {pid}; remove it if that merge is dead")
            elif pid is not None and _pid_alive(pid):
                out.append(f"{p.name}, pid {pid}")
        return out

    def check_space(self, nbytes: int, reserve: int = 0) -> None:
        """Raise :class:`DiskSpaceError` when the target filesystem has less than ``nbytes`` (+1%) plus ``reserve``
        bytes free."""
        free = shutil.disk_usage(self.tmp).free
        need = int(nbytes * 1.01) + (16 << 20) + reserve
        if free < need:
            extra = f" (including {reserve / 1e9:.2f} GB kept free for the next checkpoint)" if reserve else ""
            raise DiskSpaceError(
                f"not enough disk space for {self.target}: {need / 1e9:.2f} GB needed{extra}, {free / 1e9:.2f} GB free"
            )

    def publish(self) -> None:
        (self.tmp / OWNER_FILE).unlink(missing_ok=True)
        try:
            for p in self.tmp.rglob("*"):
                if p.is_file():
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
        except OSError as e:  # a deferred write error (ENOSPC, EIO) surfaces here
            raise TargetError(f"writing {self.target} failed: {e.strerror or e}; nothing was published") from None
        fsync_dir(self.tmp)
        old = None
        if self.target.exists():
            if any(self.target.iterdir()):
                if not self.overwrite:
                    raise TargetError(f"target {self.target} appeared while merging; pass --overwrite to replace it")
                old = self.target.parent / f".{self.target.name}.old-{os.getpid()}"
                os.rename(self.target, old)
            else:
                self.target.rmdir()
        os.rename(self.tmp, self.target)
        fsync_dir(self.target.parent)
        self.published = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.published:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


class MergeInterrupted(ShardMergeError):
    """SIGTERM arrived during a merge; the temporary output was removed."""

    exit_code = 130


class terminate_as_exception:
    """While active (main thread only), SIGTERM raises :class:`MergeInterrupted` so cleanup code runs.

    SIGINT already raises ``KeyboardInterrupt``. Previous handlers are restored on exit.
    """

    def __enter__(self):
        self._prev = None
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                raise MergeInterrupted("interrupted (SIGTERM); temporary output removed")

            try:
                self._prev = signal.signal(signal.SIGTERM, handler)
            except ValueError:
                self._prev = None
        return self

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)
        return False

