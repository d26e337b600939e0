"""Conversion of checkpoints that already use HF module names (FSDP, DCP, Lightning, accelerate).

Steps, each reported:

1. wrapper tokens that never occur in HF names are removed (``_fsdp_wrapped_module.``,
   ``_checkpoint_wrapped_module.``, ``_orig_mod.``);
2. the prefix to strip (``model.`` of a LightningModule attribute, ``module.`` of DDP, ...) is the one under which
   the most keys match the model's ``state_dict()`` keys, never a guess; keys outside that prefix belong to other
   attributes of the training module and are dropped with a note;
3. fused in-memory layouts are written as ``save_pretrained`` writes them (:mod:`shardmerge.convert.moe`);
4. tied weights: a key the config ties (``lm_head.weight``) is dropped when it holds the same values as the key it
   follows, and is an error when it differs;
5. the result must have exactly the key set and shapes ``save_pretrained`` of the installed transformers writes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..errors import ConversionError
from ..formats.base import SourceCheckpoint, TensorSource, iter_row_blocks
from .expected import ExpectedModel

WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass
class Converted:
    """HF name -> source, in the order ``save_pretrained`` would list them, plus what was decided."""

    tensors: dict[str, TensorSource]
    notes: list[str] = field(default_factory=list)
    prefix: str = ""
    dropped: list[str] = field(default_factory=list)
    tied_dropped: list[str] = field(default_factory=list)
    additions: list[str] = field(default_factory=list)
    # LoRA: (PEFT on-disk name -> source, peft LoraConfig) written to <target>/lora_adapter/
    adapter: tuple | None = None


def strip_wrappers(name: str) -> str:
    for tok in WRAPPER_TOKENS:
        name = name.replace(tok, "")
    return name


def choose_prefix(names: list[str], expected: set[str]) -> tuple[str, int]:
    """The dot-prefix under which the most ``names`` become ``expected`` keys: ``(prefix, matches)``.

    Ties go to the shorter prefix. Every prefix considered is one actually present in ``names``.
    """
    votes: Counter = Counter()
    for n in names:
        if n in expected:
            votes[""] += 1
        i = n.find(".")
        while i != -1:
            if n[i + 1 :] in expected:
                votes[n[: i + 1]] += 1
            i = n.find(".", i + 1)
    if not votes:
        return "", 0
    best = max(votes.items(), key=lambda kv: (kv[1], -len(kv[0])))
    return best


def map_names(ckpt: SourceCheckpoint, expected_names: set[str]) -> tuple[dict[str, TensorSource], str, list[str]]:
    """Training names -> model ``state_dict()`` names: ``(tensors, prefix, dropped)``."""
    cleaned: dict[str, str] = {}
    for k in ckpt.tensors:
        c = strip_wrappers(k)
        if c in cleaned:
            raise ConversionError(f"keys '{cleaned[c]}' and '{k}' both mean '{c}' in {ckpt.path}")
        cleaned[c] = k
    prefix, _ = choose_prefix(list(cleaned), expected_names)
    out: dict[str, TensorSource] = {}
    dropped: list[str] = []
    for c, k in cleaned.items():
        if c.startswith(prefix):
            out[c[len(prefix) :]] = ckpt.tensors[k]
        else:
            dropped.append(k)
    return out, prefix, dropped


def same_values(a: TensorSource, b: TensorSource, block_bytes: int = 64 << 20) -> bool:
    """Bitwise comparison of two sources of equal shape, read in row blocks of about ``block_bytes``."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    ia, ib = a.identity(), b.identity()
    if ia is not None and ia == ib:
        return True
    for box in iter_row_blocks(a.shape, a.dtype.itemsize, block_bytes):
        x, y = a.read(box), b.read(box)
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def _listing(keys: list[str], n: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def convert_hf_named(
    ckpt: SourceCheckpoint,
    exp: ExpectedModel,
    tie_word_embedding: bool | None = None,
) -> Converted:
    """Map a checkpoint with HF module names onto the on-disk key set of ``exp``.

    Raises:
        ConversionError: missing or unexpected keys (listed), shape mismatches, a tie contradiction (the config or
            ``tie_word_embedding`` says tied but the weights differ, or the user's flag contradicts the config).
    """
    notes: list[str] = []
    tensors, prefix, dropped = map_names(ckpt, set(exp.in_memory))
    if prefix:
        notes.append(f"stripped prefix '{prefix}' from {len(tensors)} keys (matched against the model's state_dict keys)")
    if dropped:
        notes.append(f"dropped {len(dropped)} keys outside '{prefix}': {_listing(dropped, 4)}")

    out = finalize(tensors, exp, str(ckpt.path), tie_word_embedding)
    out.notes = notes + out.notes
    out.prefix, out.dropped = prefix, dropped
    return out


def finalize(
    tensors: dict[str, TensorSource],
    exp: ExpectedModel,
    where: str,
    tie_word_embedding: bool | None = None,
    additions: dict[str, TensorSource] | None = None,
) -> Converted:
    """In-memory HF names -> the on-disk key set: tied weights, fused layouts, the key-set check.

    ``additions`` are declared extra tensors (e.g. Megatron MTP layers kept on request): written, reported, and not
    counted against the key set.

    Raises:
        ConversionError: see :func:`convert_hf_named`.
    """
    from . import moe

    notes: list[str] = []
    cfg_tied = exp.tie_word_embeddings
    if tie_word_embedding is not None and bool(tie_word_embedding) != cfg_tied:
        raise ConversionError(
            f"--tie-word-embedding={'true' if tie_word_embedding else 'false'} contradicts the config "
            f"(tie_word_embeddings={str(cfg_tied).lower()} in {exp.config_dir}); fix the config or drop the flag"
        )
    tied_dropped = []
    for key, follows in exp.tied.items():
        if key not in tensors:
            continue
        src = tensors.get(follows)
        if src is None:
            raise ConversionError(f"'{key}' is tied to '{follows}' by the config, but '{follows}' is not in {where}")
        if not same_values(tensors[key], src):
            raise ConversionError(
                f"the config ties '{key}' to '{follows}' (tie_word_embeddings=true) but the trained values differ "
                f"in {where}; set tie_word_embeddings=false in the config to keep the trained {key}"
            )
        del tensors[key]
        tied_dropped.append(key)
    if tied_dropped:
        notes.append(f"tied weights: {', '.join(tied_dropped)} equal their source and are not written (as save_pretrained)")

    tensors, moe_notes = moe.to_disk_layout(tensors, exp)
    notes.extend(moe_notes)

    check_key_set(tensors, exp.on_disk, where)
    # Order follows the checkpoint (the trained model's state_dict order), so the file layout depends on the
    # checkpoint alone, whichever path planned it.
    if additions:
        tensors.update(additions)
        notes.append(f"kept {len(additions)} declared additions outside the HF key set: {_listing(list(additions), 4)}")
    return Converted(tensors, notes, "", [], tied_dropped, sorted(additions or ()))


def common_prefix(names: list[str]) -> str:
    """The longest dot-boundary prefix shared by all names ("" when there is none)."""
    if not names:
        return ""
    first = names[0].split(".")
    n = len(first) - 1
    for name in names[1:]:
        parts = name.split(".")
        k = 0
        while k < min(n, len(parts) - 1) and parts[k] == first[k]:
            k += 1
        n = k
        if n == 0:
            return ""
    return ".".join(first[:n]) + "." if n else ""


def _raw_tie(raw: dict) -> bool | None:
    for d in (raw, raw.get("text_config") or {}):
        if isinstance(d, dict) and "tie_word_embeddings" in d:
            return bool(d["tie_word_embeddings"])
    return None


def speculate_hf_named(ckpt: SourceCheckpoint, raw_config: dict | None) -> Converted | None:
    """A plan from the checkpoint and the raw ``config.json`` alone, without importing model code.

    Used to start writing while the expected model is still being built; :func:`convert_hf_named` must later
    produce the same mapping (same names, same sources) or the merge is planned again. Returns ``None`` when the
    exact path is needed anyway: fused MoE experts, a tie that only a value comparison can settle, an unknown tie
    setting.
    """
    if raw_config is None:
        return None
    from .lora import has_lora

    if has_lora(ckpt.tensors):
        return None
    tie = _raw_tie(raw_config)
    if tie is None:
        return None
    cleaned = {strip_wrappers(k): k for k in ckpt.tensors}
    if len(cleaned) != len(ckpt.tensors):
        return None
    prefix = common_prefix(list(cleaned))
    tensors = {c[len(prefix):]: ckpt.tensors[k] for c, k in cleaned.items()}
    if any(".experts." in k and len(t.shape) == 3 for k, t in tensors.items()):
        return None
    notes = [f"stripped prefix '{prefix}' from {len(tensors)} keys (matched against the model's state_dict keys)"] if prefix else []
    tied_dropped: list[str] = []
    if tie:
        seen: dict = {}
        for k, t in list(tensors.items()):
            ident = t.identity()
            if ident is None:
                continue
            if ident in seen:
                del tensors[k]
                tied_dropped.append(k)
            else:
                seen[ident] = k
        if not tied_dropped:
            return None
        notes.append(f"tied weights: {', '.join(tied_dropped)} equal their source and are not written (as save_pretrained)")
    return Converted(tensors, notes, prefix, [], tied_dropped)


def same_plan(a: Converted, b: Converted) -> bool:
    """True when two conversions map the same names, in the same order, to the same source objects."""
    return list(a.tensors) == list(b.tensors) and all(a.tensors[k] is b.tensors[k] for k in a.tensors)


def check_key_set(
    tensors: dict[str, TensorSource], expected: dict[str, tuple[int, ...]], where: str, additions: set[str] = frozenset()
) -> None:
    """Raise :class:`ConversionError` unless names and shapes equal ``expected`` (plus declared ``additions``)."""
    have = set(tensors) - set(additions)
    missing = sorted(set(expected) - have)
    unexpected = sorted(have - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {_listing(unexpected)}")
        raise ConversionError(f"{where}: the key set does not match the HF model: " + "; ".join(parts))
    bad = [(k, tuple(tensors[k].shape), expected[k]) for k in expected if tuple(tensors[k].shape) != tuple(expected[k])]
    if bad:
        shown = ", ".join(f"{k} {list(s)} vs expected {list(e)}" for k, s, e in bad[:4])
        raise ConversionError(f"{where}: {len(bad)} tensor shape(s) differ from the HF model: {shown}")


__all__ = ["Converted", "convert_hf_named", "check_key_set", "choose_prefix", "same_values", "finalize"]
