"""``MergeOnSave``: a Lightning callback that gives every checkpoint an HF-format sibling, merged in the background.

Add it next to your own ``ModelCheckpoint`` (which you keep)::

    trainer = L.Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=500), MergeOnSave(dtype="bfloat16", keep_last=3)])

How it learns that a checkpoint is complete: it wraps ``trainer.save_checkpoint`` (called by ``ModelCheckpoint`` and by
user code), whose Lightning implementation returns only after the strategy's save *and its barrier*, so on return the
checkpoint is complete on every rank; global rank 0 then submits it to the background worker before
``ModelCheckpoint`` gets to rotate older checkpoints. This works for ``ModelParallelStrategy`` and ``FSDPStrategy``
DCP folders and single-file ``.ckpt`` (DDP, single device), with or without a logger. A save of weights already
submitted (``last.ckpt`` written as a copy of the same step) is not merged again; a ``last.ckpt`` symlink is never
passed to ``save_checkpoint`` at all.

Lightning checkpoints carry no HF config: when none is found on disk, the callback writes ``config.json`` and
``generation_config.json`` of the ``PreTrainedModel`` the LightningModule holds (and the tokenizer given as
``MergeOnSave(tokenizer=...)`` or found as ``tokenizer`` / ``processing_class`` on the module or datamodule) once into
``<checkpoint dir>/.shardmerge-hf/`` and hands that folder to the merge.

Options are :class:`shardmerge.MergeConfig` fields (``dtype``, ``keep_last``, ``supersede``, ``wait_on_exit``,
``device``, ``target`` ...). A failed merge is logged and recorded in ``<target>.status.json``; it never stops
training. When training ends, ``wait_on_exit=True`` (default) waits for queued merges.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from shardmerge.background import MergeWorker
from shardmerge.config import MergeConfig

log = logging.getLogger("shardmerge")

HF_SIDE_DIR = ".shardmerge-hf"


class MergeOnSave(Callback):
    """Merge each checkpoint the trainer saves into a ``{stem}_hf`` sibling, in a background process.

    Args:
        tokenizer: tokenizer or processor to save beside the config when the checkpoint folder has none.
        **options: :class:`shardmerge.MergeConfig` fields.

    Raises:
        ShardMergeError: on construction, for an unknown or invalid option.
    """

    def __init__(self, tokenizer: Any = None, **options: Any):
        self.config = MergeConfig.from_mapping(options)
        self.tokenizer = tokenizer
        self.worker: MergeWorker | None = None
        self._orig_save = None
        self._submitted_steps: set[tuple[str, int]] = set()
        self._side_dirs: dict[str, str] = {}
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self._orig_save is not None:
            return
        orig = trainer.save_checkpoint
        self._orig_save = orig
        callback = self

        def save_checkpoint(filepath, weights_only: bool = False, storage_options: Any = None):
            orig(filepath, weights_only=weights_only, storage_options=storage_options)
            # Lightning's save_checkpoint ends with the strategy barrier: the checkpoint is complete everywhere.
            callback._after_save(trainer, filepath)

        trainer.save_checkpoint = save_checkpoint

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._orig_save is not None and stage == "fit":
            trainer.save_checkpoint = self._orig_save
            self._orig_save = None
            self._finish(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._report(trainer)

    # -- work ---------------------------------------------------------------------------------------------------
    def _after_save(self, trainer, filepath) -> None:
        if trainer.global_rank != 0:
            return
        try:
            path = Path(filepath)
            if path.is_symlink():
                return
            key = (str(path.parent), int(trainer.global_step))
            if key in self._submitted_steps:
                log.info("shardmerge: %s holds step %d, already queued for merging; not merged again", path.name, key[1])
                return
            self._submitted_steps.add(key)
            side = self._hf_side_dir(trainer, path)
            if self.worker is None:
                self.worker = MergeWorker(self.config)
            self.worker.submit(path, run=str(path.parent), step=int(trainer.global_step), hf_config_dir=side)
        except Exception as e:  # noqa: BLE001 - never disturb training
            log.error("shardmerge: could not queue the merge of %s: %s", filepath, e)

    def _hf_side_dir(self, trainer, ckpt: Path) -> str | None:
        """Config (and tokenizer) of the module's PreTrainedModel, written once per checkpoint folder."""
        from shardmerge.errors import ConfigNotFoundError
        from shardmerge.hfdir import find_config_dir

        if self.config.hf_model_config_path:
            return None
        try:
            find_config_dir(ckpt)
            return None
        except ConfigNotFoundError:
            pass
        folder = str(ckpt.parent)
        if folder in self._side_dirs:
            return self._side_dirs[folder]
        model = _find_pretrained(trainer.lightning_module)
        if model is None:
            log.warning("shardmerge: no HF config near %s and no PreTrainedModel on the LightningModule; "
                        "pass hf_model_config_path=...", ckpt)
            return None
        side = ckpt.parent / HF_SIDE_DIR
        side.mkdir(parents=True, exist_ok=True)
        import copy

        cfg = copy.deepcopy(model.config)
        cfg.architectures = [_model_class_name(model)]
        cfg.save_pretrained(str(side))
        gen = getattr(model, "generation_config", None)
        if gen is not None and getattr(model, "can_generate", lambda: False)():
            gen.save_pretrained(str(side))
        tok = self.tokenizer or _find_tokenizer(trainer)
        if tok is not None and hasattr(tok, "save_pretrained"):
            tok.save_pretrained(str(side))
        self._side_dirs[folder] = str(side)
        return str(side)

    def _report(self, trainer) -> None:
        if self.worker is None:
            return
        for st in self.worker.finished():
            if st.get("state") == "done":
                log.info("shardmerge: merged %s -> %s in %.1f s", st.get("source"), st.get("target"), st.get("seconds") or 0)
                if trainer.logger is not None:
                    try:
                        trainer.logger.log_metrics(
                            {"shardmerge/merge_seconds": float(st.get("seconds") or 0), "shardmerge/bytes": float(st.get("bytes") or 0)},
                            step=st.get("step") if isinstance(st.get("step"), int) else trainer.global_step,
                        )
                    except Exception as e:  # noqa: BLE001
                        log.debug("shardmerge: logger refused metrics: %s", e)
            elif st.get("state") == "failed":
                log.warning("shardmerge: merge of %s failed: %s (status in %s.status.json)", st.get("source"), st.get("error"), st.get("target"))

    def _finish(self, trainer) -> None:
        if self.worker is None or self._closed:
            return
        self._closed = True
        self.worker.close(wait=self.config.wait_on_exit)
        if self.config.wait_on_exit:
            self._report(trainer)

    @property
    def statuses(self) -> list[dict]:
        """Status of every merge this callback queued (empty on ranks other than 0)."""
        return self.worker.statuses() if self.worker is not None else []


def _find_pretrained(module) -> Any:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for m in module.modules():
        if isinstance(m, PreTrainedModel):
            return m
    return None


def _model_class_name(model) -> str:
    # fully_shard swaps in a dynamic subclass (FSDPQwen2ForCausalLM); name the model class it derives from.
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch.distributed"):
            return cls.__name__
    return type(model).__name__


def _find_tokenizer(trainer) -> Any:
    for owner in (trainer.lightning_module, getattr(trainer, "datamodule", None)):
        for name in ("tokenizer", "processing_class", "processor"):
            tok = getattr(owner, name, None) if owner is not None else None
            if tok is not None and hasattr(tok, "save_pretrained"):
                return tok
    return None
