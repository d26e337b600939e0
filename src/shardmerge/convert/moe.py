"""In-memory fused layouts -> the layout ``save_pretrained`` writes, with transformers' own conversion rules.

transformers 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
[E, H, I]), so sharded checkpoints hold fused keys, while ``save_pretrained`` writes the per-expert layout
(``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1/w2/w3``) by running
``transformers.core_model_loading.revert_weight_conversion`` over the state dict.

Here that very function runs over *lazy proxies*: meta tensors (no data) that record which box of which
checkpoint tensor they stand for. The reversal of the fused-expert converters only chunks, squeezes and makes
contiguous (checked against transformers 5.24); each such call yields a proxy for a sub-box. The result maps every
on-disk name to a box of a checkpoint tensor, read lazily like any other :class:`TensorSource`. A conversion that
needs any other operation (e.g. a transpose or a concatenation of several sources) is refused by name rather than
guessed.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedSourceError
from ..formats.base import Sliced, TensorSource, full_box


class LazyRef(torch.Tensor):
    """A meta tensor standing for ``region`` (a box in the root tensor's dims) of checkpoint tensor ``root``,
    with the root dims in ``squeezed`` dropped."""

    sm_root: str
    sm_region: tuple[tuple[int, int], ...]
    sm_squeezed: tuple[int, ...]

    @staticmethod
    def make(root: str, meta: torch.Tensor, region, squeezed) -> "LazyRef":
        t = torch.Tensor._make_subclass(LazyRef, meta)
        t.sm_root, t.sm_region, t.sm_squeezed = root, tuple(region), tuple(squeezed)
        return t

    def _root_dim(self, d: int) -> int:
        live = [i for i in range(len(self.sm_region)) if i not in self.sm_squeezed]
        return live[d % len(live)]

    def _sub(self, meta: torch.Tensor, root_dim: int, start: int, stop: int, squeeze: bool = False) -> "LazyRef":
        region = list(self.sm_region)
        a, _ = region[root_dim]
        region[root_dim] = (a + start, a + stop)
        squeezed = tuple(sorted(set(self.sm_squeezed) | ({root_dim} if squeeze else set())))
        return LazyRef.make(self.sm_root, meta, region, squeezed)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        with torch._C.DisableTorchFunctionSubclass():
            if name in ("size", "dim", "__get__", "numel", "ndimension", "element_size", "__len__"):
                return func(*args, **kwargs)
            this = args[0]
            if name == "contiguous":
                return this
            if name in ("chunk", "split"):
                arg = args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("split_size_or_sections"))
                dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
                parts = func(this.as_subclass(torch.Tensor), arg, dim)
                rd, out, start = this._root_dim(dim), [], 0
                for p in parts:
                    n = p.shape[dim]
                    out.append(this._sub(p, rd, start, start + n))
                    start += n
                return tuple(out)
            if name == "narrow":
                dim, start, length = args[1], args[2], args[3]
                meta = func(this.as_subclass(torch.Tensor), dim, start, length)
                return this._sub(meta, this._root_dim(dim), start, start + length)
            if name == "squeeze" and (len(args) > 1 or "dim" in kwargs):
                dim = args[1] if len(args) > 1 else kwargs["dim"]
                meta = func(this.as_subclass(torch.Tensor), dim)
                if meta.dim() == this.dim():
                    return this
                rd = this._root_dim(dim)
                a, b = this.sm_region[rd]
                return this._sub(meta, rd, 0, b - a, squeeze=True)
        raise _Unsupported(name)


class _Unsupported(Exception):
    pass


def to_disk_layout(tensors: dict[str, TensorSource], exp: Any) -> tuple[dict[str, TensorSource], list[str]]:
    """Map in-memory names/layouts onto the on-disk ones of ``exp`` (identity when the model has no conversion).

    Raises:
        UnsupportedSourceError: the model's conversion uses an operation other than box slicing.
    """
    if exp.model is None or not exp.has_conversion:
        return tensors, []
    from transformers.core_model_loading import revert_weight_conversion

    probes = {
        k: LazyRef.make(k, torch.empty(t.shape, dtype=t.dtype, device="meta"), full_box(t.shape), ())
        for k, t in tensors.items()
    }
    try:
        reverted = revert_weight_conversion(exp.model, probes)
    except _Unsupported as e:
        raise UnsupportedSourceError(
            f"{exp.architecture}: transformers' save-time conversion uses '{e}', which shardmerge cannot apply lazily"
        ) from None
    out: dict[str, TensorSource] = {}
    split = 0
    for name, ref in reverted.items():
        if not isinstance(ref, LazyRef):
            raise UnsupportedSourceError(f"{exp.architecture}: conversion produced an untracked tensor for {name}")
        src = tensors[ref.sm_root]
        if ref.sm_region == full_box(src.shape) and not ref.sm_squeezed:
            out[name] = src
        else:
            out[name] = Sliced(src, ref.sm_region, ref.sm_squeezed)
            split += 1
    fused = len({ref.sm_root for ref in reverted.values() if isinstance(ref, LazyRef) and (ref.sm_squeezed or ref.sm_region != full_box(tensors[ref.sm_root].shape))})
    notes = [f"{fused} fused tensors written as {split} per-module tensors, as save_pretrained writes them"] if split else []
    return out, notes
