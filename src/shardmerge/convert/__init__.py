"""Layout conversion: training names and layouts -> HF names and layouts.

:func:`convert` picks the converter for the source family: checkpoints written with HF module names (FSDP, DCP,
Lightning, accelerate) go through :mod:`shardmerge.convert.hf`.
"""

from __future__ import annotations

from ..formats.base import SourceCheckpoint
from .expected import ExpectedModel
from .hf import Converted, convert_hf_named


def convert(ckpt: SourceCheckpoint, exp: ExpectedModel, config) -> Converted:
    """Training tensors -> the on-disk HF key set of ``exp`` (see :func:`convert_hf_named` for the errors)."""
    return convert_hf_named(ckpt, exp, tie_word_embedding=config.tie_word_embedding)


__all__ = ["convert", "Converted", "ExpectedModel"]
