"""Lazy reading of ``torch.save`` zip files (rank files, ``.ckpt``, Megatron ``model_optim_rng.pt``).

Format facts (torch.serialization, zip format since torch 1.6): the archive holds ``<prefix>/data.pkl`` (the pickled
object, storages as persistent ids ``("storage", StorageType, key, location, numel)``) and one *stored*
(uncompressed) record ``<prefix>/data/<key>`` per storage with its raw bytes in the byte order of
``<prefix>/byteorder``.

Why not ``torch.load``: it either reads every storage into memory or, with ``mmap=True``, leaves every touched page
resident until the mapping goes away. Here the pickle is replayed with storages replaced by *meta* storages (nothing
read) and every tensor remembered as a :class:`StorageSlice` (file, byte offset of its record, storage offset, size,
stride), so bytes are read later by offset, a box at a time. Storages of at most ``SMALL_STORAGE`` bytes are read at
once (device-mesh rank maps, scalars) so that metadata objects that hold them work normally.
"""

from __future__ import annotations

import io
import os
import struct
import sys
import warnings
import zipfile
from typing import Any

import torch

from ..errors import SourceError, UnsupportedSourceError
from . import safepickle
from .base import FilePool, InMemory, StorageSlice, TensorSource

SMALL_STORAGE = 64 * 1024
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


class TorchZip:
    """One ``torch.save`` file opened for lazy reading.

    Raises (on construction):
        SourceError: missing, truncated or not a torch zip file (names the file).
        UnsupportedSourceError: the legacy non-zip ``torch.save`` format or a big-endian file.
    """

    def __init__(self, path: str, pool: FilePool, base: int = 0, length: int | None = None):
        self.path = path
        self.pool = pool
        # A torch.save blob may sit inside a bigger file (DCP writes one per item at an offset of a .distcp file).
        self.base = base
        self.where = path if base == 0 and length is None else f"{path} (bytes {base}..{base + (length or 0)})"
        try:
            self.size = os.path.getsize(path) if length is None else length
            if base + self.size > os.path.getsize(path):
                raise SourceError(f"{self.where} is truncated: the file ends at {os.path.getsize(path)}")
            with open(path, "rb") as raw:
                f = _Window(raw, base, self.size)
                magic = f.read(4)
                if magic != b"PK\x03\x04":
                    if magic[:1] == b"\x80":
                        raise UnsupportedSourceError(
                            f"{self.where} uses the legacy (pre-1.6, non-zip) torch.save format; re-save it with a current torch"
                        )
                    raise SourceError(f"{self.where} is empty, truncated or not a torch.save zip file")
                f.seek(0)
                zf = zipfile.ZipFile(f)
                infos = zf.infolist()
        except FileNotFoundError:
            raise SourceError(f"{path} does not exist") from None
        except IsADirectoryError:
            raise SourceError(f"{path} is a directory, not a torch.save file") from None
        except zipfile.BadZipFile as e:
            raise SourceError(f"{self.where} is truncated or not a torch.save zip file ({e})") from None
        except OSError as e:
            raise SourceError(f"cannot read {path}: {e}") from None
        self._infos = {i.filename: i for i in infos}
        pkl = [n for n in self._infos if n.endswith("/data.pkl") and n.count("/") == 1] or [
            n for n in self._infos if n == "data.pkl"
        ]
        if not pkl:
            raise SourceError(f"{self.where} has no data.pkl record: not a torch.save file")
        self._prefix = pkl[0][: -len("data.pkl")]
        order = self._infos.get(self._prefix + "byteorder")
        if order is not None and self._read_record(order).decode() != sys.byteorder:
            raise UnsupportedSourceError(f"{self.where} was written on a {self._read_record(order).decode()}-endian machine")
        self._storages: dict[int, tuple[str, torch.dtype, int]] = {}
        self._tensors: dict[int, StorageSlice] = {}
        self._keep: list[Any] = []

    def _read_record(self, info: zipfile.ZipInfo) -> bytes:
        off = self._data_offset(info)
        buf = torch.empty(info.file_size, dtype=torch.uint8)
        self.pool.pread_into(self.path, buf, off)
        return buf.numpy().tobytes()

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        if info.compress_type != zipfile.ZIP_STORED:
            raise SourceError(f"{self.where}: record {info.filename} is compressed; torch.save never compresses records")
        head = torch.empty(_LOCAL_HEADER.size, dtype=torch.uint8)
        self.pool.pread_into(self.path, head, self.base + info.header_offset)
        fields = _LOCAL_HEADER.unpack(head.numpy().tobytes())
        if fields[0] != 0x04034B50:
            raise SourceError(f"{self.where}: bad zip local header for {info.filename} (file corrupt)")
        off = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if off + info.file_size > self.size:
            raise SourceError(f"{self.where} is truncated: record {info.filename} ends past the end of the data")
        return self.base + off

    def load(self, trust: bool = False) -> Any:
        """Replay the pickle; tensors come back as placeholders to pass to :meth:`source_of`.

        Raises:
            PickleRefusedError: a global outside the allow-list (unless ``trust``).
            SourceError: corrupt pickle or missing storage record.
        """
        info = self._infos[self._prefix + "data.pkl"]
        data = self._read_record(info)
        real_v2 = torch._utils._rebuild_tensor_v2

        def rebuild_v2(storage, storage_offset, size, stride, *rest):
            t = real_v2(storage, storage_offset, size, stride, *rest)
            self._remember(t, storage, storage_offset, size, stride)
            return t

        def rebuild_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, *rest):
            t = torch._utils._rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, *rest)
            self._remember(t, storage, storage_offset, size, stride, dtype)
            return t

        def rebuild_parameter(data, requires_grad, backward_hooks, *state):
            return data  # the Parameter wrapper would hide the tensor we track

        overrides = {
            ("torch._utils", "_rebuild_tensor_v2"): rebuild_v2,
            ("torch._utils", "_rebuild_tensor_v3"): rebuild_v3,
            ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): rebuild_parameter,
        }
        with _quiet_mesh_warning():
            return safepickle.loads(data, self.where, trust=trust, persistent_load=self._persistent_load, overrides=overrides)

    def _persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise SourceError(f"{self.where}: unknown persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * dtype.itemsize
        info = self._infos.get(f"{self._prefix}data/{key}")
        if info is None:
            raise SourceError(f"{self.where}: storage record data/{key} is missing (file truncated or corrupt)")
        offset = self._data_offset(info)
        if info.file_size < nbytes:
            raise SourceError(f"{self.where}: storage data/{key} holds {info.file_size} bytes, expected {nbytes}")
        if nbytes <= SMALL_STORAGE:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                self.pool.pread_into(self.path, buf, offset)
            untyped = buf.untyped_storage()
        else:
            untyped = torch.UntypedStorage(nbytes, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage deprecation: the unpickled tensors need typed storages
            typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        self._storages[id(typed)] = (key, dtype, offset)
        self._keep.append(typed)
        return typed

    def _remember(self, t, storage, storage_offset, size, stride, dtype=None) -> None:
        rec = self._storages.get(id(storage))
        if rec is None:
            return
        _key, sdtype, offset = rec
        tdtype = dtype or sdtype
        self._tensors[id(t)] = StorageSlice(
            pool=self.pool,
            path=self.path,
            byte_offset=offset,
            dtype=tdtype,
            storage_offset=int(storage_offset),
            shape=tuple(int(x) for x in size),
            stride=tuple(int(x) for x in stride),
        )
        self._keep.append(t)

    def source_of(self, t: torch.Tensor) -> TensorSource:
        """The lazy source of a tensor returned by :meth:`load` (a DTensor's ``_local_tensor`` included)."""
        src = self._tensors.get(id(t))
        if src is not None:
            return src
        if t.device.type == "cpu":
            return InMemory(t)
        raise SourceError(f"{self.where}: a tensor of shape {list(t.shape)} has no storage record")


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``base`` of an open file (for zipfile)."""

    def __init__(self, f, base: int, length: int):
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        data = os.pread(self.f.fileno(), n, self.base + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class _MeshWarningFilter:
    """Unpickling a DeviceMesh without process groups logs a harmless warning per mesh; drop exactly that one."""

    @staticmethod
    def filter(record) -> bool:
        return "pickling/unpickling of the DeviceMesh" not in record.getMessage()


class _quiet_mesh_warning:
    """Install :class:`_MeshWarningFilter` once on torch's device-mesh logger (thread-safe, no level changes)."""

    installed = False

    def __enter__(self):
        if not _quiet_mesh_warning.installed:
            import logging

            logging.getLogger("torch.distributed.device_mesh").addFilter(_MeshWarningFilter)
            _quiet_mesh_warning.installed = True
        return self

    def __exit__(self, *exc):
        return False
