"""verl trainer hook: ``+trainer.merge_on_save=true`` gives every saved step an HF sibling per role.

verl's trainer runs inside a Ray actor (``TaskRunner``), not in the launching process, so a patch made by a launcher
would not reach it. verl (0.9.1) imports every entry point of the group ``verl.plugins`` in each process that imports
verl; shardmerge registers this module there. Importing it installs a wrapper around
``verl.trainer.ppo.ray_trainer.RayPPOTrainer._save_checkpoint`` (immediately if that module is loaded, otherwise the
moment it is imported). With the flag off the wrapper only reads one config key per save.

With the flag on, after each completed save (``_save_checkpoint`` returns once every rank has written its files and
the tracker ``latest_checkpointed_iteration.txt`` is written) the ``actor/`` and, with a critic, ``critic/`` folders of
``global_step_N`` are submitted to a background worker and get ``actor_hf`` / ``critic_hf`` siblings. Options are
``+trainer.shardmerge.<MergeConfig field>=...``. With ``async_save`` the tracker is not written by the save, so
nothing is known to be complete: the hook logs that and merges nothing (use ``shardmerge watch``).

At the end of ``fit()`` queued merges are waited for (``wait_on_exit``, default true): the trainer's Ray actor takes
its child processes with it when it exits, so merges left queued would be lost.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Any

log = logging.getLogger("shardmerge")

TARGET_MODULE = "verl.trainer.ppo.ray_trainer"
_worker = None
_warned_async = False


def _options(config: Any) -> tuple[bool, dict]:
    """``(merge_on_save, shardmerge options)`` from a verl config (OmegaConf DictConfig)."""
    trainer = config.get("trainer", {}) if hasattr(config, "get") else {}
    flag = bool(trainer.get("merge_on_save", False)) if hasattr(trainer, "get") else False
    if not flag:
        return False, {}
    opts = trainer.get("shardmerge", None)
    if opts is None:
        return True, {}
    try:
        from omegaconf import OmegaConf

        opts = OmegaConf.to_container(opts, resolve=True)
    except (ImportError, ValueError):
        opts = dict(opts)
    return True, dict(opts or {})


def _get_worker(options: dict):
    global _worker
    if _worker is None:
        from shardmerge.background import MergeWorker
        from shardmerge.config import MergeConfig

        _worker = MergeWorker(MergeConfig.from_mapping(options))
        atexit.register(_close_at_exit)
    return _worker


def _close_at_exit() -> None:
    if _worker is not None:
        _worker.close(wait=_worker.config.wait_on_exit)


def after_save(trainer: Any) -> list:
    """Submit the role folders of the step ``trainer`` just saved (called by the wrapper; never raises)."""
    global _warned_async
    try:
        on, options = _options(trainer.config)
        if not on:
            return []
        ckpt_cfg = trainer.config.actor_rollout_ref.actor.get("checkpoint", {})
        if ckpt_cfg.get("async_save", False):
            if not _warned_async:
                log.warning("shardmerge: checkpoint.async_save is on, so no save is known to be complete here; "
                            "merge_on_save does nothing (run `shardmerge watch %s` instead)", trainer.config.trainer.default_local_dir)
                _warned_async = True
            return []
        root = os.path.abspath(trainer.config.trainer.default_local_dir)
        step_dir = os.path.join(root, f"global_step_{trainer.global_steps}")
        worker = _get_worker(options)
        jobs = []
        for role in ("actor", "critic"):
            folder = os.path.join(step_dir, role)
            if os.path.isdir(folder):
                jobs.append(worker.submit(folder, run=f"{root}:{role}", step=int(trainer.global_steps)))
        return jobs
    except Exception as e:  # noqa: BLE001 - a merge problem must never stop training
        log.error("shardmerge: merge_on_save could not queue step %s: %s", getattr(trainer, "global_steps", "?"), e)
        return []


def finish(trainer: Any = None) -> list:
    """Wait for (or leave) queued merges at the end of training, per ``wait_on_exit``."""
    if _worker is None:
        return []
    return _worker.close(wait=_worker.config.wait_on_exit)


def patch(module: Any) -> None:
    """Wrap ``RayPPOTrainer._save_checkpoint`` and ``fit`` in ``module`` (idempotent)."""
    cls = getattr(module, "RayPPOTrainer", None)
    if cls is None or getattr(cls._save_checkpoint, "_shardmerge", False):
        return
    orig_save = cls._save_checkpoint

    @functools.wraps(orig_save)
    def _save_checkpoint(self, *args, **kwargs):
        result = orig_save(self, *args, **kwargs)
        after_save(self)
        return result

    _save_checkpoint._shardmerge = True
    cls._save_checkpoint = _save_checkpoint
    orig_fit = getattr(cls, "fit", None)
    if orig_fit is not None:

        @functools.wraps(orig_fit)
        def fit(self, *args, **kwargs):
            try:
                return orig_fit(self, *args, **kwargs)
            finally:
                finish(self)

        cls.fit = fit


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the trainer module right after it is imported (nothing is imported early)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                orig_exec = loader.exec_module

                def exec_module(module, _orig=orig_exec):
                    _orig(module)
                    patch(module)

                spec.loader = _Loader(loader, exec_module)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, exec_module):
        self.inner = inner
        self._exec = exec_module

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self._exec(module)


def install() -> None:
    """Patch now if the trainer module is loaded, else when it is imported."""
    mod = sys.modules.get(TARGET_MODULE)
    if mod is not None:
        patch(mod)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


install()
