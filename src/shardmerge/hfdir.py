"""The non-weight files of a HF model directory: config, generation config, tokenizer, processor; the manifest.

Discovery order of the HF config (DESIGN): ``--hf-model-config-path``, else ``<dir>/huggingface/``, else
``<dir>/config.json``, else the same two one level up. Files are byte-copied except ``config.json``, whose dtype
field is set to what was written (``"dtype"``, and ``"torch_dtype"`` where an older file uses it).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .errors import ConfigNotFoundError

# Files of a HF model folder that are not weights (tokenizers, chat templates, processors, generation config).
HF_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece*.model",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "image_processor_config.json",
    "feature_extractor_config.json",
)
HF_DIRS = ("additional_chat_templates",)


def find_config_dir(ckpt_path: Path, explicit: str | os.PathLike | None = None) -> Path:
    """The folder holding the HF ``config.json`` for a checkpoint at ``ckpt_path`` (folder or file).

    Raises:
        ConfigNotFoundError: none found; the message lists every place looked at.
    """
    if explicit:
        p = Path(explicit).expanduser()
        if p.is_file() and p.name == "config.json":
            return p.parent
        if (p / "config.json").is_file():
            return p
        raise ConfigNotFoundError(f"--hf-model-config-path {p}: no config.json there")
    base = ckpt_path if ckpt_path.is_dir() else ckpt_path.parent
    candidates = [base / "huggingface", base, base.parent / "huggingface", base.parent]
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    looked = ", ".join(str(c / "config.json") for c in candidates)
    raise ConfigNotFoundError(f"no HF config.json found; looked at {looked}; pass --hf-model-config-path DIR")


def hf_files(config_dir: Path, trust_remote_code: bool = False) -> list[Path]:
    """Non-weight HF files in ``config_dir`` to copy (custom ``*.py`` only with ``trust_remote_code``)."""
    out = []
    for p in sorted(config_dir.iterdir()):
        if p.is_file():
            if any(fnmatch.fnmatch(p.name, pat) for pat in HF_FILE_PATTERNS):
                out.append(p)
            elif trust_remote_code and p.suffix == ".py":
                out.append(p)
        elif p.is_dir() and p.name in HF_DIRS:
            out.append(p)
    return out


def copy_hf_files(config_dir: Path, dst: Path, trust_remote_code: bool = False) -> list[str]:
    """Byte-copy the non-weight HF files; returns the names copied."""
    names = []
    for p in hf_files(config_dir, trust_remote_code):
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        else:
            shutil.copyfile(p, dst / p.name)
        names.append(p.name)
    return names


def write_config(config_dir: Path, dst: Path, dtype_name: str, architecture: str | None, updates: dict | None = None) -> dict:
    """Write ``dst/config.json``: the source file with the dtype field (and architecture, ``updates``) set.

    Keeping the user's file rather than re-serialising a ``PretrainedConfig`` preserves every field they had.
    """
    data: dict[str, Any] = json.loads((config_dir / "config.json").read_text())  # validated by load_config
    data["dtype"] = dtype_name
    if "torch_dtype" in data:
        data["torch_dtype"] = dtype_name
    if architecture and data.get("architectures") != [architecture]:
        data["architectures"] = [architecture]
    data.update(updates or {})
    (dst / "config.json").write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return data


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The ``shardmerge.json`` manifest of a complete merged folder, else ``None``."""
    p = Path(folder) / "shardmerge.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
