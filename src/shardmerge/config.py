"""MergeConfig: the single source of every option.

The CLI, the YAML files shipped in ``shardmerge.conf`` and the save-time hooks all build a :class:`MergeConfig`;
every field's ``metadata["help"]`` is the text the CLI and the YAML files show.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .errors import ShardMergeError

BACKENDS = ("auto", "fsdp", "dcp", "lightning", "megatron")
DTYPES = ("bfloat16", "float16", "float32", "source")
LORA_MODES = ("auto", "adapter", "merge", "both")
DEVICES = ("cpu", "cuda")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class MergeConfig:
    """Every option of a merge. Build with keyword arguments; unknown names raise :class:`ShardMergeError`.

    Sizes are bytes (int) or strings with a unit as in transformers' ``convert_file_size_to_int``
    (``"5GB"`` = 5·10⁹ bytes, ``"512MiB"`` = 512·2²⁰ bytes).
    """

    backend: str = _f("auto", "source format: auto, fsdp, dcp, lightning or megatron")
    target: str = _f(
        "{stem}_hf",
        "save-time target template; fields {stem} (checkpoint name without suffix), {name}, {step}, {parent}",
    )
    role: str | None = _f(None, "verl role to merge when a step holds several (actor, critic); default: all")
    hf_model_config_path: str | None = _f(None, "folder holding config.json, tokenizer and generation config")
    dtype: str = _f("bfloat16", "output dtype of floating tensors: bfloat16, float16, float32 or source")
    max_shard_size: str | int = _f("5GB", "largest output safetensors file: bytes or KB/MB/GB (powers of 10), KiB/MiB/GiB (powers of 2); a lowercase b (5Gb) means bits, as in transformers")
    memory_budget: str | int = _f("256MiB", "bytes of tensor data in flight at once (read, assembly, cast buffers)")
    workers: int = _f(0, "I/O threads (0: min(4, CPU count))")
    device: str = _f("cpu", "where casts and LoRA products run: cpu or cuda")
    cuda_memory_fraction: float = _f(0.25, "cap on the GPU memory a cuda merge may use (fraction of the device)")
    trust_remote_code: bool = _f(False, "allow custom model code named by the config (copied *.py files)")
    trust_pickle: bool = _f(False, "last resort: unpickle checkpoint objects outside the allow-list")
    check_replicas: bool = _f(True, "compare replicated pieces (HSDP, FSDP+TP) and fail if they differ")
    overwrite: bool = _f(False, "replace a non-empty target directory")
    tie_word_embedding: bool | None = _f(
        None, "assert the embedding/lm_head tie (checked against config and weights); default: from the config"
    )
    is_value_model: bool = _f(False, "write a value (critic) model: *ForTokenClassification with one label")
    lora: str = _f("auto", "LoRA output: auto (= adapter when LoRA keys are present), adapter (base + lora_adapter/), merge, both (merged + lora_adapter/)")
    lora_r: int | None = _f(None, "LoRA rank when the checkpoint does not record it")
    lora_alpha: float | None = _f(None, "LoRA alpha when the checkpoint does not record it")
    lora_rslora: bool | None = _f(None, "rank-stabilised LoRA scaling alpha/sqrt(r)")
    base_model_path: str | None = _f(None, "HF directory of the base model, for merging LoRA-only checkpoints")
    keep_mtp: bool = _f(False, "keep Megatron multi-token-prediction layers (a declared addition)")
    keep_last: int | None = _f(None, "save time: keep only the N newest merged siblings (ours only); None keeps all")
    supersede: bool = _f(False, "save time: drop a queued merge when a newer checkpoint of the same run arrives")
    wait_on_exit: bool = _f(True, "save time: wait for queued merges when training ends")
    upload_repo: str | None = _f(None, "upload the result to this HuggingFace hub repository")
    private: bool = _f(False, "create the hub repository as private")
    progress: bool | None = _f(None, "progress bar: None = only on a terminal")
    quiet: bool = _f(False, "no progress bar and no info logging")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ShardMergeError` naming the first invalid field."""
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        _choice("backend", self.backend, BACKENDS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("lora", self.lora, LORA_MODES)
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            raise ShardMergeError(f"device {self.device!r} is not one of cpu, cuda, cuda:N")
        for name in ("max_shard_size", "memory_budget"):
            parse_size(getattr(self, name), name)
        if self.workers < 0:
            raise ShardMergeError(f"workers must be >= 0, got {self.workers}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ShardMergeError(f"keep_last must be >= 1 or None, got {self.keep_last}")
        if self.lora_r is not None and self.lora_r < 1:
            raise ShardMergeError(f"lora_r must be >= 1, got {self.lora_r}")
        if self.base_model_path is not None and not __import__("os").path.isdir(self.base_model_path):
            raise ShardMergeError(f"base_model_path {self.base_model_path} is not a folder (expected a HF model directory)")
        if not 0 < self.cuda_memory_fraction <= 1:
            raise ShardMergeError(f"cuda_memory_fraction must be in (0, 1], got {self.cuda_memory_fraction}")

    def replace(self, **overrides: Any) -> "MergeConfig":
        """A copy with ``overrides`` applied (unknown names raise :class:`ShardMergeError`)."""
        return MergeConfig.from_mapping({**self.to_dict(), **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None = None, **overrides: Any) -> "MergeConfig":
        """Build from a dict (e.g. an OmegaConf node converted to a container) plus keyword overrides."""
        data = dict(values or {})
        data.update(overrides)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ShardMergeError(f"unknown MergeConfig option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size, "max_shard_size")

    @property
    def memory_budget_bytes(self) -> int:
        return parse_size(self.memory_budget, "memory_budget")


def field_help() -> dict[str, str]:
    """``{field name: help text}`` in declaration order."""
    return {f.name: f.metadata.get("help", "") for f in fields(MergeConfig)}


_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(value: str | int, name: str = "size") -> int:
    """Bytes from an int or a string such as ``"5GB"``.

    Units follow transformers' ``convert_file_size_to_int`` (``KB/MB/GB`` are powers of 10, ``KiB/MiB/GiB``
    powers of 2, a lowercase ``b`` as in ``"5Gb"`` means bits); the tests check the two agree. Parsed here rather
    than by importing transformers, which would cost about 0.5 s on the command line's critical path.

    Raises:
        ShardMergeError: the value is not a positive size.
    """
    if isinstance(value, bool):
        raise ShardMergeError(f"{name}: expected a size, got {value!r}")
    n = None
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip()
        if text.isdigit():
            n = int(text)
        else:
            for unit, mult in _UNITS.items():
                if text.upper().endswith(unit) and text[: -len(unit)].strip().isdigit():
                    n = int(text[: -len(unit)]) * mult
                    if unit in ("GB", "MB", "KB", "TB") and text.endswith("b"):
                        n //= 8
                    break
    if n is None:
        raise ShardMergeError(f"{name}: {value!r} is not a size such as '5GB', '512MiB' or a byte count")
    if n <= 0:
        raise ShardMergeError(f"{name} must be positive, got {value!r}")
    return n


def human_bytes(n: int | float | None) -> str:
    """``1.23 GB`` style (powers of 1000, as disk sizes are quoted)."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ShardMergeError(f"{name} {value!r} is not one of {', '.join(choices)}")


# -- YAML files shipped in shardmerge.conf (generated from MergeConfig; a test checks they agree) ---------------------

def _yaml_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return '"' + str(v).replace('"', '\\"') + '"'


def yaml_fields(indent: str = "") -> str:
    """Every MergeConfig field with its default and help text as YAML lines."""
    lines = []
    for f in fields(MergeConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"{indent}# {f.metadata.get('help', '')}")
        lines.append(f"{indent}{f.name}: {_yaml_value(default)}")
    return "\n".join(lines) + "\n"


CONF_FILES = {
    "shardmerge.yaml": lambda: "# shardmerge MergeConfig defaults (generated from shardmerge.config.MergeConfig)\n" + yaml_fields(),
    "lightning.yaml": lambda: (
        "# Lightning callback for Hydra apps: callbacks: [${...}] or hydra.utils.instantiate(cfg)\n"
        "# (generated from shardmerge.config.MergeConfig)\n"
        "_target_: shardmerge.hooks.lightning.MergeOnSave\n" + yaml_fields()
    ),
    "verl.yaml": lambda: (
        "# verl trainer keys (trainer.merge_on_save, trainer.shardmerge.*); on the command line:\n"
        "#   +trainer.merge_on_save=true +trainer.shardmerge.dtype=bfloat16\n"
        "# (generated from shardmerge.config.MergeConfig)\n"
        "merge_on_save: false\nshardmerge:\n" + yaml_fields("  ")
    ),
}


def write_conf(folder: str) -> None:
    """Regenerate the YAML files of ``shardmerge.conf`` into ``folder``."""
    import os

    for name, make in CONF_FILES.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(make())

