"""Compare HF directories, or a merged directory with its source checkpoint (``shardmerge verify`` / ``test``).

What is compared: every weight key both ways (missing / unexpected), shapes, dtypes and values — bit-exact where the
dtypes match, otherwise within one unit in the last place of the less precise dtype (the rounding a cast makes);
the config fields that change what the weights mean (:data:`CONFIG_FIELDS`); tokenizers by content (same tokens and
ids, same special tokens); other files are listed. Weights are read a tensor at a time through ``safetensors``.

A side that is not a HF directory (no ``config.json`` with safetensors weights) is a checkpoint: it is merged into a
temporary folder in the other side's dtype first.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ShardMergeError

CONFIG_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "num_labels", "num_experts", "num_local_experts",
    "num_experts_per_tok", "moe_intermediate_size", "hidden_act",
)


@dataclass
class VerifyReport:
    """Result of a comparison. ``ok`` is False on any weight or config-field difference (exit code 3)."""

    a: str
    b: str
    tensors_compared: int = 0
    missing_in_b: list[str] = field(default_factory=list)
    missing_in_a: list[str] = field(default_factory=list)
    shape_mismatch: list[str] = field(default_factory=list)
    dtype_differs: list[str] = field(default_factory=list)
    value_mismatch: list[str] = field(default_factory=list)
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    config_mismatch: dict[str, list] = field(default_factory=dict)
    tokenizer: str = "not compared"
    tokenizer_ok: bool = True
    other_files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing_in_a or self.missing_in_b or self.shape_mismatch or self.value_mismatch
                    or self.config_mismatch or not self.tokenizer_ok)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _weights(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = f
    return out


def _dtype_of(folder: Path) -> str:
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors"))[:1]:
        with safe_open(str(f), "pt") as h:
            for k in list(h.keys())[:64]:
                dt = h.get_slice(k).get_dtype()
                counts[dt] = counts.get(dt, 0) + 1
    name = max(counts, key=counts.get) if counts else "BF16"
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(name, "source")


def _close(x: torch.Tensor, y: torch.Tensor) -> tuple[bool, float]:
    if x.dtype == y.dtype:
        same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) if x.numel() else True
        diff = 0.0 if same else float((x.double() - y.double()).abs().nan_to_num(0.0).max())
        return same, diff
    if not (x.is_floating_point() and y.is_floating_point()):
        return torch.equal(x.to(torch.int64), y.to(torch.int64)), 0.0
    # One unit in the last place of the less precise dtype, subnormals included: eps * |x| for normal values,
    # eps * smallest_normal (the subnormal spacing) near zero.
    low = x.dtype if torch.finfo(x.dtype).eps > torch.finfo(y.dtype).eps else y.dtype
    fi = torch.finfo(low)
    a, b = x.double(), y.double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    same_nonfinite = bool(((a == b) | (a.isnan() & b.isnan()) | finite).all())
    d = (a - b).abs()[finite]
    tol = fi.eps * torch.maximum(a.abs(), b.abs())[finite] + fi.eps * fi.smallest_normal
    bad = d > tol
    ok = same_nonfinite and not bool(bad.any())
    worst = d[bad] if bool(bad.any()) else d
    return ok, float(worst.max()) if worst.numel() else 0.0


def _config_diff(a: Path, b: Path) -> dict[str, list]:
    ca = json.loads((a / "config.json").read_text())
    cb = json.loads((b / "config.json").read_text())
    out = {}
    for k in CONFIG_FIELDS:
        va, vb = _cfg_get(ca, k), _cfg_get(cb, k)
        if va != vb and not (va is None and k not in ca and vb is None):
            out[k] = [va, vb]
    return out


def _cfg_get(cfg: dict, key: str) -> Any:
    if key in cfg:
        return cfg[key]
    return (cfg.get("text_config") or {}).get(key)


def _tokenizer_diff(a: Path, b: Path) -> tuple[str, bool]:
    ta, tb = a / "tokenizer.json", b / "tokenizer.json"
    if not ta.exists() and not tb.exists():
        return "no tokenizer on either side", True
    if not ta.exists() or not tb.exists():
        return f"tokenizer.json only in {'A' if ta.exists() else 'B'}", False
    if ta.read_bytes() == tb.read_bytes() and _bytes(a / "tokenizer_config.json") == _bytes(b / "tokenizer_config.json"):
        return "identical files", True
    from tokenizers import Tokenizer

    x, y = Tokenizer.from_file(str(ta)), Tokenizer.from_file(str(tb))
    if x.get_vocab(with_added_tokens=True) != y.get_vocab(with_added_tokens=True):
        return "different tokens or ids", False
    sx, sy = _special(a), _special(b)
    if sx != sy:
        return f"different special tokens ({sx} vs {sy})", False
    return "same tokens, ids and special tokens (files differ in format)", True


def _bytes(p: Path) -> bytes | None:
    return p.read_bytes() if p.exists() else None


def _special(folder: Path) -> dict:
    out = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        p = folder / name
        if p.exists():
            d = json.loads(p.read_text())
            for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
                if d.get(k) is not None:
                    v = d[k]
                    out[k] = v.get("content") if isinstance(v, dict) else v
    return out


def _files(a: Path, b: Path) -> dict[str, str]:
    skip = {"config.json", "tokenizer.json", "model.safetensors.index.json", "shardmerge.json"}
    names = {p.name for p in a.iterdir() if p.is_file()} | {p.name for p in b.iterdir() if p.is_file()}
    out = {}
    for n in sorted(names - skip):
        if n.endswith(".safetensors"):
            continue
        pa, pb = a / n, b / n
        if not pa.exists():
            out[n] = "only in B"
        elif not pb.exists():
            out[n] = "only in A"
        elif pa.read_bytes() != pb.read_bytes():
            out[n] = "differs"
    return out


def compare_dirs(a: Path, b: Path) -> VerifyReport:
    """Compare two HF directories (see module docstring)."""
    from safetensors import safe_open

    rep = VerifyReport(str(a), str(b))
    wa, wb = _weights(a), _weights(b)
    rep.missing_in_b = sorted(set(wa) - set(wb))
    rep.missing_in_a = sorted(set(wb) - set(wa))
    handles: dict[Path, Any] = {}

    def get(path: Path, key: str) -> torch.Tensor:
        h = handles.get(path)
        if h is None:
            h = handles[path] = safe_open(str(path), "pt")
        return h.get_tensor(key)

    for k in sorted(set(wa) & set(wb)):
        x, y = get(wa[k], k), get(wb[k], k)
        rep.tensors_compared += 1
        if tuple(x.shape) != tuple(y.shape):
            rep.shape_mismatch.append(f"{k}: {list(x.shape)} vs {list(y.shape)}")
            continue
        if x.dtype != y.dtype:
            rep.dtype_differs.append(f"{k}: {x.dtype} vs {y.dtype}".replace("torch.", ""))
        ok, diff = _close(x, y)
        if not ok:
            rep.value_mismatch.append(k)
            rep.max_abs_diff[k] = diff
        del x, y
    rep.config_mismatch = _config_diff(a, b)
    rep.tokenizer, rep.tokenizer_ok = _tokenizer_diff(a, b)
    rep.other_files = _files(a, b)
    if rep.dtype_differs:
        rep.notes.append(f"{len(rep.dtype_differs)} tensors differ in dtype; values compared within one ulp of the less precise dtype")
    return rep


def verify(a: str | os.PathLike, b: str | os.PathLike, trust_pickle: bool = False) -> VerifyReport:
    """Compare ``a`` and ``b``: two HF directories, or a HF directory and the checkpoint it was merged from.

    Raises:
        ShardMergeError: neither side is a HF directory, or a checkpoint side cannot be merged.
    """
    pa, pb = Path(a), Path(b)
    if is_hf_dir(pa) and is_hf_dir(pb):
        return compare_dirs(pa, pb)
    if not is_hf_dir(pa) and not is_hf_dir(pb):
        raise ShardMergeError(f"neither {pa} nor {pb} is a HF directory (config.json with *.safetensors)")
    hf, ckpt = (pa, pb) if is_hf_dir(pa) else (pb, pa)
    from .engine import MANIFEST_OPTIONS, merge
    from .hfdir import read_manifest

    # A folder we wrote records the options that decided its content (LoRA mode, value model, ...): use them.
    recorded = (read_manifest(hf) or {}).get("options") or {}
    opts = {k: v for k, v in recorded.items() if k in MANIFEST_OPTIONS and k != "dtype"}
    with tempfile.TemporaryDirectory(prefix="shardmerge-verify-") as tmp:
        out = Path(tmp) / "merged"
        merge(ckpt, out, dtype=_dtype_of(hf), quiet=True, trust_pickle=trust_pickle, **opts)
        rep = compare_dirs(hf, out) if hf == pa else compare_dirs(out, hf)
        rep.notes.append(f"{ckpt} merged to a temporary folder in {_dtype_of(hf)} for the comparison")
        if hf == pa:
            rep.b = str(ckpt)
        else:
            rep.a = str(ckpt)
        return rep


def merge_and_compare(source: str | os.PathLike, reference: str | os.PathLike, config=None) -> VerifyReport:
    """verl's ``test``: merge ``source`` into a temporary folder in the reference's dtype and compare with it.

    Raises:
        ShardMergeError: the reference is not a HF directory, or the merge fails.
    """
    from .config import MergeConfig
    from .engine import merge

    ref = Path(reference)
    if not is_hf_dir(ref):
        raise ShardMergeError(f"--test_hf_dir {ref} is not a HF directory (config.json with *.safetensors)")
    cfg = (config or MergeConfig()).replace(dtype=_dtype_of(ref), quiet=True)
    with tempfile.TemporaryDirectory(prefix="shardmerge-test-") as tmp:
        out = Path(tmp) / "merged"
        merge(source, out, cfg)
        rep = compare_dirs(out, ref)
        rep.a = str(source)
        rep.notes.append(f"merged in {cfg.dtype} (the reference's dtype) to a temporary folder")
        return rep


def print_verify(rep: VerifyReport) -> None:
    rows = [("A", rep.a), ("B", rep.b), ("tensors compared", str(rep.tensors_compared))]
    for label, items in (("missing in B", rep.missing_in_b), ("missing in A", rep.missing_in_a),
                         ("shape differs", rep.shape_mismatch), ("values differ", rep.value_mismatch),
                         ("dtype differs", rep.dtype_differs)):
        if items:
            shown = ", ".join(items[:6]) + (f" (+{len(items) - 6} more)" if len(items) > 6 else "")
            rows.append((label, f"{len(items)}: {shown}"))
    for k, (va, vb) in rep.config_mismatch.items():
        rows.append(("config differs", f"{k}: {va!r} vs {vb!r}"))
    rows.append(("tokenizer", rep.tokenizer))
    for n, what in rep.other_files.items():
        rows.append(("file", f"{n}: {what}"))
    for n in rep.notes:
        rows.append(("note", n))
    rows.append(("result", "SAME" if rep.ok else "DIFFERENT"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
