"""Layout conversion: training names and layouts -> HF names and layouts.

:func:`convert` picks the converter for the source family: checkpoints written with HF module names (FSDP, DCP,
Lightning, accelerate) go through :mod:`shardmerge.convert.hf`; PEFT LoRA checkpoints are first taken apart by
:mod:`shardmerge.convert.lora`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..errors import ConversionError
from ..formats.base import SourceCheckpoint
from . import lora
from .expected import ExpectedModel
from .hf import Converted, convert_hf_named


def convert(ckpt: SourceCheckpoint, exp: ExpectedModel, config) -> Converted:
    """Training tensors -> the on-disk HF key set of ``exp``, plus a LoRA adapter when the checkpoint has one.

    Raises:
        ConversionError: see :func:`convert_hf_named`; LoRA settings unknown; ``--lora merge`` of a LoRA-only
            checkpoint without ``--base-model-path``.
    """
    if ckpt.format == "megatron":
        from .megatron import convert_megatron

        return convert_megatron(ckpt, exp, config.tie_word_embedding, config.keep_mtp)
    sp = lora.split(ckpt)
    if sp is None:
        if config.lora in ("merge", "both", "adapter"):
            raise ConversionError(f"--lora {config.lora}: {ckpt.path} holds no LoRA keys (lora_A/lora_B)")
        return convert_hf_named(ckpt, exp, tie_word_embedding=config.tie_word_embedding)
    mode = "adapter" if config.lora == "auto" else config.lora
    s = lora.settings(sp, ckpt, config, exp.config_dir, exp.architecture)
    merge = mode in ("merge", "both")
    base = dict(sp.base)
    base_from = str(ckpt.path)
    if sp.lora_only:
        if merge and not config.base_model_path:
            raise ConversionError(
                f"{ckpt.path} is a LoRA-only checkpoint (no base weights): --lora {mode} needs --base-model-path DIR, "
                "the HF directory of the base model"
            )
        if config.base_model_path:
            from ..formats.safetensors_dir import read_hf_dir

            base = read_hf_dir(Path(config.base_model_path))
            base_from = str(config.base_model_path)
    if merge:
        base.update(sp.saved)  # merge_and_unload keeps the trained modules_to_save copies
    notes = []
    if base:
        conv = convert_hf_named(replace(ckpt, tensors=base, path=base_from), exp, tie_word_embedding=config.tie_word_embedding)
    else:
        conv = Converted({}, [])
    if merge:
        for name, m in sp.modules.items():
            key = f"{name}.weight"
            if key not in conv.tensors:
                raise ConversionError(f"LoRA module {name} has no base weight {key} in the HF model's key set")
            conv.tensors[key] = lora.LoraMerged(conv.tensors[key], m, s.scale, config.device)
    kinds = sorted({n.rsplit(".", 1)[-1] for n in sp.modules})
    notes.append(
        f"LoRA: r={s.r} alpha={s.alpha:g}{' rsLoRA' if s.rslora else ''}{' DoRA' if s.dora else ''} (from {s.source}), "
        f"scale {s.scale:g}, {len(sp.modules)} modules ({', '.join(kinds)})"
        + (f", modules_to_save {sorted({k.rsplit('.', 2)[-2] for k in sp.saved})}" if sp.saved else "")
    )
    if merge:
        notes.append(f"LoRA merged into {len(sp.modules)} weights (float32 math, on {config.device})")
    if mode in ("adapter", "both"):
        raw = {}
        if exp.config_dir is not None and (exp.config_dir / "config.json").is_file():
            raw = json.loads((exp.config_dir / "config.json").read_text())
        base_name = raw.get("_name_or_path") or config.base_model_path or None
        conv.adapter = (lora.adapter_tensors(sp), lora.adapter_config(sp, s, base_name))
        notes.append("LoRA adapter written to lora_adapter/ (adapter tensors keep their training dtype)")
    conv.notes = conv.notes + notes
    return conv


__all__ = ["convert", "Converted", "ExpectedModel"]
