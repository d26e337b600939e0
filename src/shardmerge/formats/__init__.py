"""Source formats: discovery (:func:`locate`), detection (:func:`detect`) and one reader module per family."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SourceError, UnsupportedSourceError
from .base import FilePool, ShapeOracle, SourceCheckpoint, TensorSource  # noqa: F401
from .fsdp import rank_files

ROLES = ("actor", "critic")
_STEP_PATTERNS = (r"global_step_(\d+)", r"iter_(\d+)", r"checkpoint-(\d+)", r"step=(\d+)", r"step_(\d+)")


@dataclass
class Located:
    """One checkpoint to merge, found from the path the user named.

    Attributes:
        path: folder (or single file) the reader opens.
        backend: reader family.
        reason: why this backend was chosen (shown by ``inspect`` and the log).
        role: verl role (``actor``/``critic``) when the path held several.
        step: training step when the path names it.
        chain: discovery steps taken from the named path to ``path``.
    """

    path: Path
    backend: str
    reason: str
    role: str | None = None
    step: int | None = None
    chain: list[str] = field(default_factory=list)


def step_of(path: Path) -> int | None:
    for part in reversed(path.parts):
        for pat in _STEP_PATTERNS:
            m = re.search(pat, part)
            if m:
                return int(m.group(1))
    return None


def _megatron_markers(p: Path) -> list[str]:
    found = [n for n in ("metadata.json", "common.pt") if (p / n).is_file()]
    if any(c.is_dir() and c.name.startswith("mp_rank_") for c in p.iterdir()):
        found.append("mp_rank_* folders")
    for sub in ("dist_ckpt", "model/dist_ckpt"):
        if (p / sub).is_dir():
            found.append(f"{sub}/")
    return found


def detect(p: Path) -> tuple[str, str]:
    """``(backend, reason)`` for a folder or file, from markers only.

    Raises:
        SourceError: nothing recognisable (lists what was looked for).
    """
    if p.is_file():
        from .fsdp import RANK_FILE

        m = RANK_FILE.match(p.name)
        if m and int(m.group(1)) > 1:
            raise SourceError(
                f"{p} is one rank's file of a {m.group(1)}-rank FSDP checkpoint; point at the folder holding all rank files ({p.parent})"
            )
        if p.suffix in (".ckpt", ".pt", ".pth", ".bin"):
            return "lightning", f"{p.name} is a single checkpoint file"
        raise SourceError(f"{p} is a file but not a .ckpt/.pt checkpoint")
    markers = _megatron_markers(p)
    if markers:
        return "megatron", f"Megatron markers present ({', '.join(markers)})"
    files = rank_files(p)
    if files:
        return "fsdp", f"{len(files)} model_world_size_{files[0][0]}_rank_R.pt rank files"
    if (p / ".metadata").is_file() or any(p.glob("*.distcp")):
        if (p / "meta.pt").is_file():
            return "dcp", "Lightning sharded checkpoint (.metadata, *.distcp, meta.pt)"
        if p.name.startswith("pytorch_model_fsdp"):
            return "dcp", "accelerate FSDP checkpoint (torch.distributed.checkpoint folder)"
        return "dcp", "torch.distributed.checkpoint folder (.metadata / *.distcp)"
    steps = sorted(c.name for c in p.iterdir() if c.is_dir() and re.match(r"^(global_step_|iter_|checkpoint-)\d+$", c.name))
    hint = f"; it holds {', '.join(steps[-3:])}: point at one of them" if steps else ""
    raise SourceError(
        f"{p}: no checkpoint found (looked for model_world_size_W_rank_R.pt rank files, a DCP .metadata, "
        "Megatron metadata.json/common.pt or mp_rank_* folders, verl actor/ or critic/ folders, "
        f"latest_checkpointed_iteration.txt){hint}"
    )


def locate(path: str | Path, backend: str = "auto", role: str | None = None) -> list[Located]:
    """Resolve the path a user or trainer named to the checkpoint folder(s) to merge.

    Order (DESIGN "Where things are found"): a root with ``latest_checkpointed_iteration.txt`` means its latest
    step; a verl step holding ``actor/`` and ``critic/`` means both roles (or ``role``); a trainer folder holding
    ``pytorch_model_fsdp_0/`` means that subfolder; then the backend is detected from markers.

    Raises:
        SourceError: the path does not exist or holds no checkpoint; the tracker file names a missing step.
        UnsupportedSourceError: a recognised but unsupported format.
    """
    p = Path(os.path.abspath(Path(path).expanduser()))  # "." and ".." become real names (default targets use them)
    if not p.exists():
        raise SourceError(f"{p} does not exist")
    chain: list[str] = []
    tracker = p / "latest_checkpointed_iteration.txt"
    if p.is_dir() and tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            candidates = [p / "release"]
        elif text.isdigit():
            n = int(text)
            candidates = [p / f"global_step_{n}", p / f"iter_{n:07d}", p / f"iter_{n}"]
        else:
            raise SourceError(f"{tracker} holds {text!r}, not a step number")
        hit = next((c for c in candidates if c.is_dir()), None)
        if hit is None:
            raise SourceError(
                f"{tracker} names step {text} but none of {', '.join(c.name for c in candidates)} exists in {p}"
            )
        chain.append(f"{tracker.name} says {text} -> {hit.name}")
        p = hit
    if p.is_dir() and (p / "pytorch_model_fsdp_0").is_dir() and not (p / ".metadata").exists():
        chain.append("trainer folder holds pytorch_model_fsdp_0/ -> that subfolder")
        p = p / "pytorch_model_fsdp_0"

    roles = [r for r in ROLES if p.is_dir() and (p / r).is_dir()] if p.is_dir() and not _looks_like_checkpoint(p) else []
    if role is not None and roles and role not in roles:
        raise SourceError(f"{p}: no '{role}' folder (found: {', '.join(roles)})")
    if role is not None and not roles and p.name != role:
        if (p / role).is_dir():
            roles = [role]
        else:
            raise SourceError(f"{p}: no '{role}' folder")
    if roles:
        chosen = [role] if role else roles
        out = []
        for r in chosen:
            sub = p / r
            b, why = _check_backend(sub, backend)
            out.append(Located(sub, b, why, role=r, step=step_of(sub), chain=chain + [f"role {r} -> {r}/"]))
        return out
    b, why = _check_backend(p, backend)
    return [Located(p, b, why, step=step_of(p), chain=chain)]


def _looks_like_checkpoint(p: Path) -> bool:
    try:
        detect(p)
        return True
    except SourceError:
        return False


def _check_backend(p: Path, backend: str) -> tuple[str, str]:
    found, why = detect(p)
    if backend == "auto":
        return found, why
    if backend == found:
        return found, f"--backend {backend} ({why})"
    fsdp_family = ("fsdp", "dcp", "lightning")
    if backend in fsdp_family and found in fsdp_family:
        # verl users type --backend fsdp out of habit; what is on disk decides the reader.
        return found, f"--backend {backend} given; read as {found}: {why}"
    if found == "megatron":
        raise SourceError(f"{p} is a Megatron checkpoint ({why}), not {backend}; use --backend megatron or auto")
    raise SourceError(f"{p}: --backend {backend} given but the folder looks like {found} ({why})")


def open_reader(loc: Located):
    """The reader function for a located checkpoint: ``reader(path, pool, shape_oracle, trust_pickle=...,
    check_replicas=...) -> SourceCheckpoint``."""
    if loc.backend == "fsdp":
        from .fsdp import read_fsdp

        return read_fsdp
    if loc.backend == "dcp":
        from .dcp import read_dcp

        return read_dcp
    if loc.backend == "lightning":
        from .lightning import read_single_file

        return read_single_file
    if loc.backend == "megatron":
        from .megatron import read_megatron

        return read_megatron
    raise UnsupportedSourceError(f"{loc.path}: the {loc.backend} format is not supported")
