"""``shardmerge watch ROOT``: merge each newly completed checkpoint under a folder, for trainers without a hook.

Completion markers (a half-written checkpoint is never merged):

* verl / Megatron-LM run roots: ``latest_checkpointed_iteration.txt`` is written after a save completes; step folders
  up to the step it names are complete (``global_step_N/actor``, ``critic``; rank files directly in the step folder
  for verl's SFT trainer; ``iter_NNNNNNN`` for Megatron);
* ``torch.distributed.checkpoint`` folders (plain, Lightning ``*.ckpt/``, accelerate): ``.metadata``, written after
  every rank's data;
* Megatron ``torch_dist`` folders: ``metadata.json``, written last;
* single-file ``*.ckpt`` / ``*.pt``: a readable zip directory (written at the very end) and a size unchanged since the
  previous scan; ``last.ckpt`` symlinks are skipped.

Restart-safe: a target that already holds our manifest, or whose status file records a failure, is skipped (delete
the status file to retry). One watcher per root: a lock file refuses a second one.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .background import PIN_DIR, Job, pin, read_status, run_job, write_status
from .config import MergeConfig
from .errors import ShardMergeError
from .hfdir import read_manifest

log = logging.getLogger("shardmerge")
LOCK = ".shardmerge-watch.lock"
MAX_DEPTH = 5


@dataclass
class Found:
    path: Path
    step: int | None
    why: str


def _tracker_step(p: Path) -> int | None:
    t = p / "latest_checkpointed_iteration.txt"
    if not t.is_file():
        return None
    text = t.read_text().strip()
    return int(text) if text.isdigit() else None


def _step_dirs(root: Path, upto: int) -> list[tuple[int, Path]]:
    out = []
    for d in root.iterdir():
        for prefix in ("global_step_", "iter_"):
            if d.is_dir() and d.name.startswith(prefix) and d.name[len(prefix):].isdigit():
                n = int(d.name[len(prefix):])
                if n <= upto:
                    out.append((n, d))
    return sorted(out)


def _is_output(p: Path) -> bool:
    return read_manifest(p) is not None or p.name.startswith(".") or ".partial-" in p.name


def scan(root: Path, sizes: dict[str, int]) -> list[Found]:
    """Completed checkpoints under ``root``; ``sizes`` carries single-file sizes between scans."""
    from .formats import rank_files

    found: list[Found] = []

    def walk(p: Path, depth: int) -> None:
        if depth > MAX_DEPTH or not p.is_dir() or _is_output(p) and p != root:
            return
        upto = _tracker_step(p)
        if upto is not None:
            for n, step_dir in _step_dirs(p, upto):
                roles = [step_dir / r for r in ("actor", "critic") if (step_dir / r).is_dir()]
                if roles:
                    found.extend(Found(r, n, f"{p.name}/latest_checkpointed_iteration.txt says {upto}") for r in roles)
                elif rank_files(step_dir) or (step_dir / "metadata.json").is_file() or any(step_dir.glob("mp_rank_*")):
                    found.append(Found(step_dir, n, f"{p.name}/latest_checkpointed_iteration.txt says {upto}"))
            return
        if (p / ".metadata").is_file() or (p / "metadata.json").is_file() and (p / "common.pt").is_file():
            found.append(Found(p, None, ".metadata written" if (p / ".metadata").is_file() else "metadata.json written"))
            return
        for child in sorted(p.iterdir()):
            if child.is_symlink():
                continue
            if child.is_file() and child.suffix in (".ckpt", ".pt") and not child.name.startswith("."):
                if rank_files(p):
                    continue  # rank files of an FSDP folder without a tracker: completion unknown
                size = child.stat().st_size
                key = str(child)
                if sizes.get(key) == size and _zip_complete(child):
                    found.append(Found(child, None, "complete single file (size stable, zip directory present)"))
                sizes[key] = size
            elif child.is_dir() and child.name != PIN_DIR:
                walk(child, depth + 1)

    walk(root, 0)
    return found


def _zip_complete(p: Path) -> bool:
    try:
        with zipfile.ZipFile(p) as z:
            return bool(z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


class _Lock:
    def __init__(self, root: Path):
        self.path = root / LOCK
        self.fd: int | None = None

    def __enter__(self) -> "_Lock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.pread(self.fd, 64, 0).decode(errors="replace").strip()
            os.close(self.fd)
            raise ShardMergeError(f"another shardmerge watch is following {self.path.parent} (pid {other or '?'}); only one may") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc) -> bool:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            try:
                self.path.unlink()
            except OSError:
                pass
        return False


def watch(root: str | os.PathLike, config: MergeConfig | None = None, once: bool = False, interval: float = 10.0,
          on_result=None, stop=None) -> list[dict]:
    """Follow ``root`` and merge each newly completed checkpoint (see module docstring).

    Args:
        once: merge what is complete now, then return.
        interval: seconds between scans.
        on_result: called with each job's final status.
        stop: callable returning True to end the loop (SIGINT/SIGTERM also end it).

    Returns:
        the final status of every merge this call ran.

    Raises:
        ShardMergeError: ``root`` is missing, or another watcher holds it.
    """
    from .engine import default_target

    cfg = config or MergeConfig()
    rootp = Path(root).resolve()
    if not rootp.is_dir():
        raise ShardMergeError(f"{rootp} is not a folder")
    results: list[dict] = []
    sizes: dict[str, int] = {}
    stopping = {"now": False}

    def handler(signum, frame):
        stopping["now"] = True

    prev = [signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)] if not once else None
    try:
        with _Lock(rootp):
            first = True
            while True:
                for f in scan(rootp, sizes):
                    target = default_target(f.path, cfg.target, f.step)
                    if read_manifest(target) is not None:
                        continue
                    st = read_status(target)
                    if st and st.get("state") in ("failed", "running", "queued", "superseded"):
                        continue
                    pinned, note = pin(f.path)
                    job = Job(uuid.uuid4().hex[:12], str(f.path), str(target), f"watch:{rootp}", cfg.to_dict(),
                              pinned=str(pinned) if pinned else None, step=f.step)
                    write_status(target, state="queued", job=job.id, source=job.source, target=job.target, run=job.run,
                                 step=f.step, error=None, submitted=job.submitted, started=None, finished=None,
                                 seconds=None, pin=note, found=f.why)
                    log.info("merging %s (%s)", f.path, f.why)
                    run_job(job)
                    final = read_status(target) or {}
                    results.append(final)
                    if on_result:
                        on_result(final)
                if once and (not first or not _waiting_files(sizes)):
                    break
                first = False
                if stopping["now"] or (stop is not None and stop()):
                    break
                time.sleep(0.5 if once else interval)
    finally:
        if prev:
            for s, h in zip((signal.SIGINT, signal.SIGTERM), prev):
                signal.signal(s, h)
    return results


def _waiting_files(sizes: dict[str, int]) -> bool:
    # --once: single files need two scans (size stability); take a second scan when any were seen.
    return bool(sizes)


def run_watch(args) -> int:
    """CLI entry: ``shardmerge watch ROOT [--once] ...``; exit 1 when a merge failed in ``--once`` mode."""
    from .cli import config_from_args

    cfg = config_from_args(args)  # watch's options are validated by argparse types and MergeConfig

    def show(st: dict) -> None:
        if args.json:
            print(json.dumps(st), flush=True)
        else:
            line = f"{st.get('state', '?'):>6}  {st.get('source')} -> {st.get('target')}"
            if st.get("error"):
                line += f"  ({st['error']})"
            print(line, flush=True)

    results = watch(args.root, cfg, once=args.once, interval=args.interval, on_result=show)
    return 1 if args.once and any(r.get("state") == "failed" for r in results) else 0
