"""Megatron save hook: an HF sibling for every checkpoint a Megatron-LM / megatron-core training script saves.

One line after your save (every rank may call it; global rank 0 acts)::

    from shardmerge.hooks.megatron import merge_after_save
    save_checkpoint(iteration, model, optimizer, scheduler, ...)     # Megatron-LM, or dist_checkpointing.save(...)
    merge_after_save(args.save, iteration, dtype="bfloat16")          # -> <save>/iter_0000100_hf/

or, with Megatron-LM, ``install(dtype="bfloat16")`` once before training: it wraps
``megatron.training.checkpointing.save_checkpoint`` to do the same. ``finish()`` at the end of training waits for
queued merges (``wait_on_exit``).

Completion: a checkpoint is submitted only once its save is finalized: ``metadata.json`` written in the torch_dist
folder (megatron-core writes it last) and, for a Megatron-LM root, ``latest_checkpointed_iteration.txt`` naming at
least that iteration. With ``--async-save`` the save returns before that; such checkpoints are kept pending and a
small polling thread submits each one as soon as it is finalized. The merge itself runs in shardmerge's background
worker process, never in the trainer.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("shardmerge")

_hook = None


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0"))


def checkpoint_dir(save_dir: str | os.PathLike, iteration: int | None) -> Path:
    """The folder of ``iteration`` under a Megatron-LM save root (``iter_0000100``), or ``save_dir`` itself."""
    root = Path(save_dir)
    if iteration is not None and (root / f"iter_{iteration:07d}").exists():
        return root / f"iter_{iteration:07d}"
    return root


def is_finalized(folder: Path, iteration: int | None) -> bool:
    """True when the save in ``folder`` is complete (torch_dist ``metadata.json``; Megatron-LM tracker)."""
    from shardmerge.formats.megatron import dist_dir, rank_dirs

    d = dist_dir(folder)
    if d is not None and not (d / "metadata.json").is_file():
        return False
    if d is None and not rank_dirs(folder):
        return False
    tracker = folder.parent / "latest_checkpointed_iteration.txt"
    if iteration is not None and folder.name.startswith("iter_"):
        if not tracker.is_file():
            return False
        text = tracker.read_text().strip()
        return text.isdigit() and int(text) >= iteration
    return True


class MegatronSaveHook:
    """Submits finalized Megatron checkpoints to a background merge worker (rank 0 only).

    Args:
        poll_interval: seconds between checks of pending (async) saves.
        **options: :class:`shardmerge.MergeConfig` fields.
    """

    def __init__(self, poll_interval: float = 2.0, **options: Any):
        from shardmerge.background import MergeWorker
        from shardmerge.config import MergeConfig

        self.config = MergeConfig.from_mapping(options)
        self.worker = MergeWorker(self.config)
        self.pending: list[tuple[Path, int | None]] = []
        self.submitted: set[str] = set()
        self.poll_interval = poll_interval
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def after_save(self, save_dir: str | os.PathLike, iteration: int | None = None) -> None:
        """Call after each save (and its barrier); never raises."""
        if _rank() != 0:
            return
        try:
            folder = checkpoint_dir(save_dir, iteration).resolve()
            with self._lock:
                self.pending.append((folder, iteration))
            self._poll()
            with self._lock:
                waiting = bool(self.pending)
            if waiting and self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shardmerge-megatron-poll", daemon=True)
                self._thread.start()
        except Exception as e:  # noqa: BLE001 - never disturb training
            log.error("shardmerge: could not queue the merge of %s: %s", save_dir, e)

    def _poll(self) -> None:
        with self._lock:
            ready = [(f, i) for f, i in self.pending if is_finalized(f, i)]
            self.pending = [(f, i) for f, i in self.pending if (f, i) not in ready]
        for folder, iteration in ready:
            if str(folder) in self.submitted:
                continue
            self.submitted.add(str(folder))
            self.worker.submit(folder, run=str(folder.parent), step=iteration)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception as e:  # noqa: BLE001
                log.error("shardmerge: %s", e)
            self._stop.wait(self.poll_interval)

    def finish(self, timeout: float | None = None) -> list[dict]:
        """End of training: submit what became final, then wait for queued merges (``wait_on_exit``)."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            self._poll()
            with self._lock:
                if not self.pending or (deadline is not None and time.time() > deadline):
                    left = list(self.pending)
                    break
            time.sleep(min(self.poll_interval, 0.5))
        if left:
            log.warning("shardmerge: %d save(s) never finalized, not merged: %s", len(left), ", ".join(str(f) for f, _ in left))
        self._stop.set()
        return self.worker.close(wait=self.config.wait_on_exit, timeout=timeout)


def merge_after_save(save_dir: str | os.PathLike, iteration: int | None = None, **options: Any) -> None:
    """One-line hook: merge the checkpoint of ``iteration`` under ``save_dir`` once its save is finalized."""
    global _hook
    if _rank() != 0:
        return
    if _hook is None:
        _hook = MegatronSaveHook(**options)
    _hook.after_save(save_dir, iteration)


def finish(timeout: float | None = None) -> list[dict]:
    """Wait for the merges queued by :func:`merge_after_save` (call at the end of training)."""
    global _hook
    if _hook is None:
        return []
    hook, _hook = _hook, None
    return hook.finish(timeout)


def install(**options: Any) -> bool:
    """Wrap Megatron-LM's ``megatron.training.checkpointing.save_checkpoint`` so each save is merged.

    Returns:
        False when Megatron-LM is not importable (nothing patched).
    """
    try:
        import megatron.training.checkpointing as ckpt
    except ImportError:
        return False
    if getattr(ckpt.save_checkpoint, "_shardmerge", False):
        return True
    orig = ckpt.save_checkpoint

    @functools.wraps(orig)
    def save_checkpoint(iteration, *args, **kwargs):
        result = orig(iteration, *args, **kwargs)
        try:
            from megatron.training import get_args

            merge_after_save(get_args().save, iteration, **options)
        except Exception as e:  # noqa: BLE001
            log.error("shardmerge: merge hook failed after saving iteration %s: %s", iteration, e)
        return result

    save_checkpoint._shardmerge = True
    ckpt.save_checkpoint = save_checkpoint
    return True
