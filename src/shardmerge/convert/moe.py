"""Fused in-memory layouts -> the layout ``save_pretrained`` writes (placeholder: dense models pass through).

Issue 3 fills this in for MoE experts; for dense models the in-memory and on-disk key sets are equal.
"""

from __future__ import annotations

from ..formats.base import TensorSource


def to_disk_layout(tensors: dict[str, TensorSource], exp) -> tuple[dict[str, TensorSource], list[str]]:
    return tensors, []
