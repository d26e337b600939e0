"""shardmerge: sharded training checkpoints -> exact HuggingFace model directories.

Public API::

    from shardmerge import merge, inspect, MergeConfig
    report = merge("ckpt/global_step_100/actor", "out/step100-hf", dtype="bfloat16")
"""

__version__ = "0.1.0"

from .config import MergeConfig  # noqa: E402
from .errors import (  # noqa: E402
    ConfigNotFoundError,
    ConversionError,
    DiskSpaceError,
    DtypeError,
    PickleRefusedError,
    ShardMergeError,
    SourceError,
    TargetError,
    UnsupportedSourceError,
    UploadError,
    VerifyFailed,
)


def __getattr__(name):
    # The engine imports torch; keep `import shardmerge` (and the CLI's --help) light until it is needed.
    if name in ("merge", "inspect", "MergeReport"):
        from . import engine

        return getattr(engine, name)
    if name in ("verify", "VerifyReport"):
        from . import verify

        return getattr(verify, name)
    raise AttributeError(f"module 'shardmerge' has no attribute {name!r}")


__all__ = [
    "merge",
    "inspect",
    "verify",
    "MergeConfig",
    "MergeReport",
    "VerifyReport",
    "ShardMergeError",
    "SourceError",
    "UnsupportedSourceError",
    "PickleRefusedError",
    "ConfigNotFoundError",
    "ConversionError",
    "DtypeError",
    "TargetError",
    "DiskSpaceError",
    "VerifyFailed",
    "UploadError",
]
