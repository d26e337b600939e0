"""Session fixtures: real sharded checkpoints written once per test session by torch's FSDP2/FSDP1 on gloo."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import ckpt_writers  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """A private expected-model cache for the session (never the user's ~/.cache)."""
    d = tmp_path_factory.mktemp("sm-cache")
    old = os.environ.get("SHARDMERGE_CACHE_DIR")
    os.environ["SHARDMERGE_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("SHARDMERGE_CACHE_DIR", None)
    else:
        os.environ["SHARDMERGE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def fsdp_ckpts(tmp_path_factory) -> Path:
    """All jobs of :data:`ckpt_writers.JOBS` (FSDP2 W=2/W=4, HSDP 2x2, Shard(1), FSDP+TP 2x2, FSDP1, plain).

    ``SHARDMERGE_FIXTURES=/path`` reuses checkpoints written by an earlier session (development speed-up).
    """
    reuse = os.environ.get("SHARDMERGE_FIXTURES")
    if reuse and all((Path(reuse) / j / "reference.pt").exists() for j in ckpt_writers.JOBS):
        return Path(reuse)
    out = tmp_path_factory.mktemp("fsdp")
    ckpt_writers.build(out)
    return out


@pytest.fixture
def ckpt_copy(fsdp_ckpts, tmp_path):
    """Copy one job's checkpoint into the test's own folder (for tests that damage or extend it)."""

    def make(job: str) -> Path:
        dst = tmp_path / job
        shutil.copytree(fsdp_ckpts / job, dst)
        return dst

    return make


def leftovers(folder: Path) -> list[str]:
    """Temporary or partial outputs left in ``folder`` (must be none after any merge, failed or not)."""
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name)
