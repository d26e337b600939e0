"""LoRA: split a PEFT-wrapped checkpoint into the base model and a PEFT adapter, or merge the adapter in.

PEFT key facts (peft 0.21, checked against ``get_peft_model`` state dicts and ``save_pretrained`` output):

* in memory, under the ``base_model.model.`` wrapper: ``<module>.base_layer.weight`` (frozen base),
  ``<module>.lora_A.<adapter>.weight`` [r, in], ``<module>.lora_B.<adapter>.weight`` [out, r],
  ``<module>.lora_embedding_A.<adapter>`` [r, num_embeddings], ``<module>.lora_embedding_B.<adapter>`` [dim, r],
  DoRA ``<module>.lora_magnitude_vector.<adapter>.weight`` [out], and for ``modules_to_save``
  ``<module>.original_module.<param>`` (untouched) beside ``<module>.modules_to_save.<adapter>.<param>`` (trained);
* on disk (``adapter_model.safetensors``) the adapter name is dropped: ``base_model.model.<module>.lora_A.weight``,
  ``...lora_embedding_A``, ``...lora_magnitude_vector``, and a trained ``modules_to_save`` copy is
  ``base_model.model.<module>.<param>``;
* merging (``merge_and_unload``): ``W + scale * (B @ A)`` with ``scale = alpha / r`` (``alpha / sqrt(r)`` with
  rsLoRA); embeddings add ``(B @ A).T``; DoRA multiplies each output row of ``W + scale * B @ A`` by
  ``magnitude / ||row||₂``.

Merged rows are computed lazily, a row block at a time, in float32 (on the GPU with ``device="cuda"``), from the base
rows, the matching rows of B (or columns of A for embeddings) and the whole small factor.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConversionError, ShardMergeError
from ..formats.base import Box, SourceCheckpoint, TensorSource, full_box

_ADAPTER = r"(?:\.(?P<adapter>[^.]+))?"
_PATTERNS = [
    ("A", re.compile(r"^(?P<mod>.+)\.lora_A" + _ADAPTER + r"\.weight$")),
    ("B", re.compile(r"^(?P<mod>.+)\.lora_B" + _ADAPTER + r"\.weight$")),
    ("embA", re.compile(r"^(?P<mod>.+)\.lora_embedding_A" + _ADAPTER + r"$")),
    ("embB", re.compile(r"^(?P<mod>.+)\.lora_embedding_B" + _ADAPTER + r"$")),
    ("mag", re.compile(r"^(?P<mod>.+)\.lora_magnitude_vector" + _ADAPTER + r"(?:\.weight)?$")),
]
_BASE_LAYER = re.compile(r"^(?P<mod>.+)\.base_layer\.(?P<param>[^.]+)$")
_ORIGINAL = re.compile(r"^(?P<mod>.+)\.original_module\.(?P<param>[^.]+)$")
_SAVED = re.compile(r"^(?P<mod>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>[^.]+)$")
PEFT_WRAPPER = "base_model.model."


def has_lora(names) -> bool:
    return any(".lora_A" in n or ".lora_embedding_A" in n or ".base_layer." in n or ".modules_to_save." in n for n in names)


@dataclass
class LoraModule:
    """The adapter pieces of one adapted module (``name`` is the module's HF path, e.g. ``model.layers.0.mlp.up_proj``)."""

    name: str
    A: TensorSource | None = None
    B: TensorSource | None = None
    embedding: bool = False
    magnitude: TensorSource | None = None

    @property
    def r(self) -> int:
        return int(self.A.shape[0])


@dataclass
class LoraSplit:
    """A LoRA checkpoint taken apart: base tensors (HF in-memory names), adapted modules, trained module copies."""

    base: dict[str, TensorSource]
    modules: dict[str, LoraModule]
    saved: dict[str, TensorSource]  # modules_to_save trained copies: "<module>.<param>" -> source
    adapter_names: set[str] = field(default_factory=set)

    @property
    def lora_only(self) -> bool:
        return not any(k for k in self.base)


def split(ckpt: SourceCheckpoint) -> LoraSplit | None:
    """Separate base, adapter and trained-copy tensors; ``None`` when the checkpoint holds no LoRA keys.

    Training prefixes before ``base_model.model.`` (Lightning attribute paths, ``_fsdp_wrapped_module.`` ...) are
    dropped; keys without it keep their name.

    Raises:
        ConversionError: several adapters in one checkpoint, or a module with only one of A/B.
    """
    from .hf import strip_wrappers

    if not has_lora(ckpt.tensors):
        return None
    base: dict[str, TensorSource] = {}
    modules: dict[str, LoraModule] = {}
    saved: dict[str, TensorSource] = {}
    adapters: set[str] = set()
    for key, src in ckpt.tensors.items():
        name = strip_wrappers(key)
        i = name.find(PEFT_WRAPPER)
        if i >= 0:
            name = name[i + len(PEFT_WRAPPER):]
        for kind, pat in _PATTERNS:
            m = pat.match(name)
            if m:
                mod = modules.setdefault(m["mod"], LoraModule(m["mod"]))
                if m["adapter"]:
                    adapters.add(m["adapter"])
                if kind in ("A", "embA"):
                    mod.A, mod.embedding = src, kind == "embA"
                elif kind in ("B", "embB"):
                    mod.B = src
                else:
                    mod.magnitude = src
                break
        else:
            m = _BASE_LAYER.match(name) or _ORIGINAL.match(name)
            if m:
                base[f"{m['mod']}.{m['param']}"] = src
                continue
            m = _SAVED.match(name)
            if m:
                adapters.add(m["adapter"])
                saved[f"{m['mod']}.{m['param']}"] = src
                continue
            base[name] = src
    if len(adapters) > 1:
        raise ConversionError(f"{ckpt.path} holds several LoRA adapters ({', '.join(sorted(adapters))}); one at a time is supported")
    for mod in modules.values():
        if mod.A is None or mod.B is None:
            raise ConversionError(f"{ckpt.path}: LoRA module {mod.name} has {'lora_A' if mod.A is not None else 'lora_B'} only")
    return LoraSplit(base, modules, saved, adapters)


@dataclass
class LoraSettings:
    r: int
    alpha: float
    rslora: bool = False
    dora: bool = False
    task_type: str | None = None
    source: str = ""

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r


def settings(split_: LoraSplit, ckpt: SourceCheckpoint, cfg, config_dir: Path | None, architecture: str | None) -> LoraSettings:
    """Rank and alpha from, in order: the user's ``--lora-r/--lora-alpha/--lora-rslora``, verl's
    ``lora_train_meta.json``, an ``adapter_config.json`` beside the checkpoint or its HF config; ``r`` may also come
    from the factors' shapes. An unknown alpha is an error, never a default.

    Raises:
        ConversionError: alpha unknown, or the recorded rank disagrees with the factors' shapes.
    """
    meta: dict[str, Any] = {}
    where = ""
    for p in [Path(ckpt.path) / "adapter_config.json", Path(ckpt.path).parent / "adapter_config.json"] + (
        [config_dir / "adapter_config.json"] if config_dir else []
    ):
        if p.is_file():
            meta, where = json.loads(p.read_text()), str(p)
            break
    lm = ckpt.extra.get("lora_train_meta")
    if lm:
        meta = {**meta, **lm}
        where = "lora_train_meta.json"
    shapes_r = {m.r for m in split_.modules.values()}
    r = cfg.lora_r if cfg.lora_r is not None else meta.get("r", meta.get("lora_rank"))
    if r is None and len(shapes_r) == 1:
        r, where = next(iter(shapes_r)), where or "the factors' shapes"
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else meta.get("lora_alpha", meta.get("alpha"))
    if alpha is None or r is None:
        raise ConversionError(
            f"{ckpt.path}: LoRA {'alpha' if alpha is None else 'rank'} unknown (no lora_train_meta.json or "
            "adapter_config.json with it); pass --lora-alpha (and --lora-r) as used in training"
        )
    if shapes_r and int(r) not in shapes_r and not meta.get("rank_pattern"):
        raise ConversionError(f"{ckpt.path}: LoRA rank {r} (from {where or 'the flags'}) but the factors have rank {sorted(shapes_r)}")
    rslora = cfg.lora_rslora if cfg.lora_rslora is not None else bool(meta.get("use_rslora", False))
    dora = any(m.magnitude is not None for m in split_.modules.values())
    task = meta.get("task_type") or _task_for(architecture)
    if float(alpha) == 0:
        raise ConversionError(f"{ckpt.path}: LoRA alpha is 0 (from {where or 'the flags'}): the adapter would do nothing")
    return LoraSettings(int(r), float(alpha), rslora, dora, task, where or "the flags")


def _task_for(architecture: str | None) -> str | None:
    if not architecture:
        return None
    for suffix, task in (("ForCausalLM", "CAUSAL_LM"), ("ForTokenClassification", "TOKEN_CLS"),
                         ("ForSequenceClassification", "SEQ_CLS"), ("ForConditionalGeneration", "SEQ_2_SEQ_LM")):
        if architecture.endswith(suffix):
            return task
    return None


@dataclass(eq=False)
class LoraMerged(TensorSource):
    """``base + scale * (B @ A)`` (``(B @ A).T`` for embeddings), optionally DoRA-normalised per row, computed a row
    block at a time in float32 on ``device`` and returned in the base's dtype. Shapes: base [out, in], A [r, in],
    B [out, r] (embeddings: base [V, H], A [r, V], B [H, r])."""

    base: TensorSource
    module: LoraModule
    scale: float
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.shape = tuple(self.base.shape)
        self.dtype = self.base.dtype
        self._A = None

    def files(self) -> set[str]:
        return self.base.files() | self.module.A.files() | self.module.B.files()

    def _full_A(self) -> torch.Tensor:
        if self._A is None:
            self._A = self.module.A.read(full_box(self.module.A.shape)).to(self.device, torch.float32)
        return self._A

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        (r0, r1), cols = box[0], box[1:]
        rows = ((r0, r1),) + tuple((0, n) for n in self.shape[1:])
        w = self.base.read(rows).to(self.device, torch.float32)
        m = self.module
        if m.embedding:
            a = m.A.read(((0, m.A.shape[0]), (r0, r1))).to(self.device, torch.float32)  # [r, rows]
            b = m.B.read(full_box(m.B.shape)).to(self.device, torch.float32)  # [H, r]
            w = w + (b @ a).T * self.scale
        else:
            b = m.B.read(((r0, r1), (0, m.B.shape[1]))).to(self.device, torch.float32)  # [rows, r]
            w = w + (b @ self._full_A()) * self.scale
            if m.magnitude is not None:
                mag = m.magnitude.read(((r0, r1),)).to(self.device, torch.float32)
                w = w * (mag / torch.linalg.norm(w, dim=1)).view(-1, 1)
        sel = w[(slice(None),) + tuple(slice(a, b) for a, b in cols)]
        out.copy_(sel.to(self.dtype).cpu() if sel.device.type != "cpu" else sel.to(self.dtype))


def adapter_key(module: str, kind: str) -> str:
    """PEFT's on-disk key for an adapter tensor."""
    suffix = {"A": "lora_A.weight", "B": "lora_B.weight", "embA": "lora_embedding_A", "embB": "lora_embedding_B",
              "mag": "lora_magnitude_vector"}[kind]
    return f"{PEFT_WRAPPER}{module}.{suffix}"


def adapter_tensors(split_: LoraSplit) -> dict[str, TensorSource]:
    out: dict[str, TensorSource] = {}
    for name, m in split_.modules.items():
        out[adapter_key(name, "embA" if m.embedding else "A")] = m.A
        out[adapter_key(name, "embB" if m.embedding else "B")] = m.B
        if m.magnitude is not None:
            out[adapter_key(name, "mag")] = m.magnitude
    for key, src in split_.saved.items():
        out[f"{PEFT_WRAPPER}{key}"] = src
    return out


def adapter_config(split_: LoraSplit, s: LoraSettings, base_name_or_path: str | None):
    """peft's own ``LoraConfig`` for the adapter (``save_pretrained`` writes ``adapter_config.json``).

    Raises:
        ShardMergeError: peft is not installed.
    """
    try:
        from peft import LoraConfig
    except ImportError:
        raise ShardMergeError("writing a LoRA adapter needs peft: pip install peft") from None
    targets = sorted({name.rsplit(".", 1)[-1] for name in split_.modules})
    saved = sorted({k.rsplit(".", 2)[-2] for k in split_.saved}) or None
    alpha = int(s.alpha) if float(s.alpha).is_integer() else s.alpha
    return LoraConfig(r=s.r, lora_alpha=alpha, target_modules=targets, task_type=s.task_type, use_rslora=s.rslora,
                      use_dora=s.dora, modules_to_save=saved, base_model_name_or_path=base_name_or_path,
                      inference_mode=True)
