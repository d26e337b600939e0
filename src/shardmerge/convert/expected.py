"""What the installed transformers expects: the key set and shapes ``save_pretrained`` would write for a config.

Built from the model class instantiated on the meta device (no memory, about 0.5 s for the model code import),
then passed through transformers' own save-time steps: ``_keys_to_ignore_on_save``,
``remove_tied_weights_from_state_dict`` and ``revert_weight_conversion`` (fused in-memory MoE experts back to the
per-expert on-disk layout).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigNotFoundError, ConversionError

log = logging.getLogger("shardmerge")


@dataclass
class ExpectedModel:
    """The HF side of a merge.

    Attributes:
        config: the ``PretrainedConfig``.
        config_dir: folder the config came from.
        architecture: model class name written to ``config.json`` (e.g. ``Qwen2ForCausalLM``).
        in_memory: ``state_dict()`` key -> shape of the meta model (what trainers shard).
        on_disk: key -> shape that ``save_pretrained`` writes (tied keys removed, conversions reverted).
        tied: ``{tied key: key it follows}`` when the config ties weights (e.g. ``lm_head.weight`` ->
            ``model.embed_tokens.weight``), else empty.
        model: the meta model (for transformers' conversion helpers).
    """

    config: Any
    config_dir: Path | None
    architecture: str
    in_memory: dict[str, tuple[int, ...]]
    on_disk: dict[str, tuple[int, ...]]
    tied: dict[str, str]
    model: Any = field(repr=False, default=None)
    from_cache: bool = False

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.tied)

    @property
    def has_conversion(self) -> bool:
        """True when ``save_pretrained`` renames or reshapes in-memory tensors (e.g. fused MoE experts)."""
        kept = {k: v for k, v in self.in_memory.items() if k not in self.tied}
        return kept != self.on_disk

    @classmethod
    def from_json(cls, data: dict, config_dir: Path | None, from_cache: bool = False) -> "ExpectedModel":
        """The inverse of :meth:`to_json` (no config or model object)."""
        return cls(
            config=None,
            config_dir=config_dir,
            architecture=data["architecture"],
            in_memory={k: tuple(v) for k, v in data["in_memory"].items()},
            on_disk={k: tuple(v) for k, v in data["on_disk"].items()},
            tied=dict(data["tied"]),
            from_cache=from_cache,
        )

    def to_json(self) -> dict:
        return {
            "architecture": self.architecture,
            "in_memory": {k: list(v) for k, v in self.in_memory.items()},
            "on_disk": {k: list(v) for k, v in self.on_disk.items()},
            "tied": self.tied,
        }


def load_config(config_dir: Path, trust_remote_code: bool = False) -> Any:
    """``AutoConfig`` from ``config_dir``, with a one-line error for unknown model types.

    Raises:
        ConfigNotFoundError: no ``config.json``.
        ConversionError: the model type is unknown to the installed transformers (and no remote code allowed), or
            the file is not valid JSON.
    """
    from transformers import AutoConfig

    path = config_dir / "config.json"
    if not path.is_file():
        raise ConfigNotFoundError(f"{path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{path} holds a JSON {type(raw).__name__}, expected an object (a HF model config)")
    try:
        return AutoConfig.from_pretrained(str(config_dir), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as e:
        import transformers

        mt = raw.get("model_type")
        if raw.get("auto_map") and not trust_remote_code:
            raise ConversionError(
                f"{path}: model_type {mt!r} needs custom code (auto_map); pass --trust-remote-code if you trust it"
            ) from None
        raise ConversionError(
            f"{path}: model_type {mt!r} is not known to the installed transformers {transformers.__version__} "
            f"({str(e).splitlines()[0][:160]})"
        ) from None


def _model_class(config: Any, is_value_model: bool, trust_remote_code: bool) -> Any:
    import transformers

    archs = list(getattr(config, "architectures", None) or [])
    if is_value_model:
        if not archs or not archs[0].endswith("ForTokenClassification"):
            from transformers import AutoModelForTokenClassification

            return AutoModelForTokenClassification, None
    if archs:
        name = archs[0]
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls, name
        auto_map = getattr(config, "auto_map", None) or {}
        for auto_name, ref in auto_map.items():
            if isinstance(ref, str) and ref.endswith("." + name) and trust_remote_code:
                return getattr(transformers, auto_name), None
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM, None


def build_expected(
    config_dir: Path | None,
    trust_remote_code: bool = False,
    is_value_model: bool = False,
    config: Any = None,
) -> ExpectedModel:
    """Instantiate the model for the config on the meta device and derive the expected state dicts.

    Raises:
        ConversionError: unknown model type, or the model cannot be built from the config.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if config is None:
        config = load_config(config_dir, trust_remote_code)
    if is_value_model:
        config.num_labels = 1
    cls, _ = _model_class(config, is_value_model, trust_remote_code)
    try:
        with torch.device("meta"):
            if hasattr(cls, "from_config"):
                model = cls.from_config(config, trust_remote_code=trust_remote_code)
            else:
                model = cls._from_config(config)
    except Exception as e:  # model code raises arbitrary types on bad configs
        raise ConversionError(
            f"cannot build {getattr(cls, '__name__', cls)} from {config_dir or 'the given config'}: {type(e).__name__}: {e}"
        ) from None
    sd = model.state_dict()
    in_memory = {k: tuple(v.shape) for k, v in sd.items()}
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    sd = {k: v for k, v in sd.items() if k not in ignore}
    kept = remove_tied_weights_from_state_dict(dict(sd), model)
    tied = {}
    declared = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for k in sd:
        if k not in kept:
            tied[k] = declared.get(k, "")
    on_disk = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, kept).items()}
    architecture = type(model).__name__
    return ExpectedModel(config, config_dir, architecture, in_memory, on_disk, tied, model)


CACHE_SCHEMA = 1


def cache_dir() -> Path | None:
    """Folder of the expected-key-set cache: ``$SHARDMERGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardmerge`` or
    ``~/.cache/shardmerge``; ``SHARDMERGE_CACHE_DIR=""`` disables it."""
    env = os.environ.get("SHARDMERGE_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardmerge"


def _cache_key(config_dir: Path, is_value_model: bool) -> str | None:
    try:
        raw = (config_dir / "config.json").read_bytes()
    except OSError:
        return None
    if b'"auto_map"' in raw:
        return None  # custom model code may change without the config changing
    from importlib.metadata import version

    h = hashlib.sha256()
    for part in (str(CACHE_SCHEMA).encode(), version("transformers").encode(), str(bool(is_value_model)).encode(), raw):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()


def cached_expected(config_dir: Path | None, is_value_model: bool = False) -> ExpectedModel | None:
    """The expected key set saved by an earlier :func:`build_expected` for byte-identical ``config.json``, the same
    transformers version and the same value-model flag; ``None`` when absent or unreadable.

    A hit skips importing transformers' model code (about 1.5 s), which matters at save time, where every
    checkpoint of a run has the same config. Models with a conversion (fused MoE) still need the model object and
    are rebuilt by the caller.
    """
    root = cache_dir()
    if root is None or config_dir is None:
        return None
    key = _cache_key(config_dir, is_value_model)
    if key is None:
        return None
    try:
        return ExpectedModel.from_json(json.loads((root / f"expected-{key}.json").read_text()), config_dir, from_cache=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_expected(exp: ExpectedModel, is_value_model: bool = False) -> None:
    """Save ``exp`` for :func:`cached_expected` (atomic write; failures are ignored: the cache is optional)."""
    root = cache_dir()
    if root is None or exp.config_dir is None:
        return
    key = _cache_key(exp.config_dir, is_value_model)
    if key is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".expected-{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(exp.to_json()))
        os.replace(tmp, root / f"expected-{key}.json")
    except OSError as e:
        log.debug("expected-model cache not written: %s", e)


def expected_via_subprocess(config_dir: Path, is_value_model: bool = False, timeout: float = 300.0) -> ExpectedModel:
    """Build the expected key set in a child interpreter (``python -m shardmerge.convert.expected``).

    The model-code import is pure-Python, GIL-bound work of about 1.5 s; in a child it runs on another core
    while this process reads and writes tensors. The child also stores the cache entry. The result carries no
    model object (``model=None``).

    Raises:
        the :class:`ShardMergeError` subclass the child reported (same message), or ``RuntimeError`` when the child
        failed otherwise (the caller then builds in-process).
    """
    import subprocess
    import sys

    from .. import errors

    cmd = [sys.executable, "-m", "shardmerge.convert.expected", str(config_dir)] + (["--value-model"] if is_value_model else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"expected-model helper failed ({proc.returncode}): {proc.stderr.strip()[-500:]}") from None
    if "error" in data:
        cls = getattr(errors, data["error"]["type"], None)
        if isinstance(cls, type) and issubclass(cls, errors.ShardMergeError):
            raise cls(data["error"]["message"])
        raise RuntimeError(data["error"]["message"])
    return ExpectedModel.from_json(data, config_dir)


def _main(argv: list[str]) -> int:
    from ..errors import ShardMergeError

    config_dir = Path(argv[0])
    value = "--value-model" in argv[1:]
    try:
        exp = build_expected(config_dir, is_value_model=value)
        store_expected(exp, value)
        print(json.dumps(exp.to_json()))
    except ShardMergeError as e:
        print(json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
