"""Error hierarchy of shardmerge.

Every error the library raises on purpose derives from :class:`ShardMergeError`. Its message is one line that says
which file (or key) is concerned, what is wrong and, where there is something to do, what to do. The CLI prints that
line as the last line on stderr, without a traceback, and exits with the class's ``exit_code``.

Exit codes of the ``shardmerge`` command:

====  ==========================================================================
0     success (``verify``/``test``: no difference)
1     a :class:`ShardMergeError`: bad or incomplete input, refused target, ...
2     command-line usage error (argparse)
3     ``verify``/``test`` ran and found differences
130   interrupted (SIGINT / SIGTERM); temporary output removed
====  ==========================================================================
"""

from __future__ import annotations


class ShardMergeError(Exception):
    """Base class: a one-line, user-facing error."""

    exit_code = 1

    def __init__(self, message: str):
        # Messages are shown as one line: fold accidental newlines.
        super().__init__(" ".join(str(message).split()))


class SourceError(ShardMergeError):
    """The checkpoint is missing, incomplete, truncated, unreadable or inconsistent."""


class PickleRefusedError(SourceError):
    """A pickle in the checkpoint references a global outside the allow-list."""


class UnsupportedSourceError(ShardMergeError):
    """The checkpoint was recognised but its format or a feature of it is not supported."""


class ConfigNotFoundError(ShardMergeError):
    """No HuggingFace ``config.json`` was found in any of the places looked at."""


class ConversionError(ShardMergeError):
    """The converted key set, shapes or tie state do not match what the HF model expects."""


class DtypeError(ShardMergeError):
    """A requested dtype cast would change values (e.g. a finite value beyond float16's range)."""


class TargetError(ShardMergeError):
    """The output directory cannot be written: exists, busy, inside the source, ..."""


class DiskSpaceError(TargetError):
    """Not enough free space for the planned output."""


class VerifyFailed(ShardMergeError):
    """A comparison found differences (exit code 3)."""

    exit_code = 3


class UploadError(ShardMergeError):
    """The hub upload failed; the local output is kept."""
