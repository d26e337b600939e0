"""What the installed transformers expects: the key set and shapes ``save_pretrained`` would write for a config.

Built from the model class instantiated on the meta device (no memory, about 0.5 s for the model code import),
then passed through transformers' own save-time steps: ``_keys_to_ignore_on_save``,
``remove_tied_weights_from_state_dict`` and ``revert_weight_conversion`` (fused in-memory MoE experts back to the
per-expert on-disk layout).
"""

from __future__ import annotations

import json
import logging
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

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.tied)


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
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON ({e})") from None
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
