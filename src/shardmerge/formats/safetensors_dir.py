"""Lazy reading of a HuggingFace directory's ``*.safetensors`` files (the base model of a LoRA-only merge).

Format facts (safetensors): 8-byte little-endian header length N, N bytes of JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets relative to the data section that starts at
8 + N), row-major little-endian data. Tensors are exposed as :class:`StorageSlice` sources read by offset, so a base
model is streamed like any checkpoint; ``safetensors.safe_open`` would map the whole file and keep touched pages
resident.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ..errors import SourceError
from .base import FilePool, StorageSlice, TensorSource, contiguous_strides

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}

_POOL = FilePool()


def read_hf_dir(folder: Path, pool: FilePool | None = None) -> dict[str, TensorSource]:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by name (metadata only).

    Raises:
        SourceError: no safetensors files, or a header that is not valid.
    """
    pool = pool or _POOL
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{folder}: no *.safetensors files (expected a HuggingFace model directory)")
    out: dict[str, TensorSource] = {}
    for f in files:
        with open(f, "rb") as h:
            raw = h.read(8)
            if len(raw) < 8:
                raise SourceError(f"{f} is truncated")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(h.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SourceError(f"{f}: invalid safetensors header ({e})") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES.get(info["dtype"])
            if dtype is None:
                raise SourceError(f"{f}: tensor {name} has unsupported dtype {info['dtype']}")
            shape = tuple(info["shape"])
            begin, _ = info["data_offsets"]
            out[name] = StorageSlice(pool, str(f), 8 + n + begin, dtype, 0, shape, contiguous_strides(shape))
    return out
