"""merge() and inspect(): reader -> converter -> writer, with parallel I/O and progress.

Flow of one merge:

1. :func:`shardmerge.formats.locate` resolves the path (tracker file, roles, trainer subfolders) and the backend;
2. the HF config folder is found and the expected model (meta device) is built in a thread while the reader
   replays the rank files' pickles (metadata only);
3. the converter maps training names and layouts onto the on-disk key set ``save_pretrained`` would write;
4. the writer plans every file, checks free space, streams row blocks into a temporary sibling, writes index,
   config, tokenizer files and the manifest last, and renames the folder into place.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .config import MergeConfig, human_bytes
from .convert import Converted, convert
from .convert.expected import ExpectedModel, build_expected, cached_expected, expected_via_subprocess, store_expected
from .convert.hf import same_plan, speculate_hf_named, strip_wrappers
from .errors import ConfigNotFoundError, ShardMergeError, TargetError
from .formats import Located, locate, open_reader
from .formats.base import FilePool, SourceCheckpoint
from .hfdir import copy_hf_files, find_config_dir, write_config, write_json
from .writer import MANIFEST, OWNER_FILE, CastStats, OutTensor, PlannedFile, Staging, WriteCancelled, index_json, plan_files, terminate_as_exception, write_files

log = logging.getLogger("shardmerge")

MANIFEST_SCHEMA = 1
MANIFEST_OPTIONS = ("dtype", "lora", "lora_r", "lora_alpha", "lora_rslora", "base_model_path", "is_value_model",
                    "keep_mtp", "tie_word_embedding", "hf_model_config_path", "trust_remote_code")


@dataclass
class MergeReport:
    """What a merge (or an inspection) did and found. ``to_dict()`` is what ``--json`` prints.

    Sizes are bytes, times seconds. ``roles`` holds one report per verl role when the source held several.
    """

    source: str
    target: str | None = None
    format: str = ""
    reason: str = ""
    discovery: list[str] = field(default_factory=list)
    role: str | None = None
    step: int | None = None
    world_size: int = 0
    mesh: str | None = None
    placements: dict[str, int] = field(default_factory=dict)
    config_dir: str | None = None
    architecture: str | None = None
    tie_word_embeddings: bool | None = None
    dtype: str | None = None
    source_dtypes: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    nonfinite: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    predicted_peak_bytes: int | None = None
    planned: list[dict] = field(default_factory=list)
    roles: dict[str, "MergeReport"] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["roles"] = {k: v.to_dict() for k, v in self.roles.items()}
        return d


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def output_dtype(requested: str, src: torch.dtype) -> torch.dtype:
    """Output dtype for a source dtype: floating tensors take ``requested`` unless it is ``source``; integer and
    bool tensors are never cast."""
    if requested == "source" or not src.is_floating_point:
        return src
    return getattr(torch, requested)


def default_target(src: Path, template: str = "{stem}_hf", step: int | None = None) -> Path:
    """Target folder from a template with fields ``{stem}``, ``{name}``, ``{step}``, ``{parent}``.

    A relative result is placed beside the source (``global_step_100/actor`` -> ``global_step_100/actor_hf``;
    ``epoch=0-step=6.ckpt`` -> ``epoch=0-step=6_hf``).
    """
    stem = src.name[: -len(src.suffix)] if src.suffix in (".ckpt", ".pt", ".pth") else src.name
    text = template.format(stem=stem, name=src.name, step="" if step is None else step, parent=str(src.parent))
    p = Path(text).expanduser()
    return p if p.is_absolute() else src.parent / p


class _Plan:
    """Everything known before writing: the located source, what was read, the HF side and the file plan.

    The expected model (meta device, transformers' model code) is built in a thread started before the reader
    runs. When it is not ready once the reader is done, the plan is *speculative*: made from the checkpoint and
    the raw ``config.json`` (:func:`speculate_hf_named`) so writing can start; :meth:`confirm` later compares it
    with the exact conversion and replaces it if they differ (the caller then writes again).
    """

    def __init__(self, loc: Located, cfg: MergeConfig):
        self.loc = loc
        self.cfg = cfg
        self.pool = FilePool()
        self.ckpt: SourceCheckpoint | None = None
        self.exp: ExpectedModel | None = None
        self.converted: Converted | None = None
        self.speculative = False
        self.confirmed = False
        self.out: list[OutTensor] = []
        self.files: list[PlannedFile] = []
        self.notes: list[str] = []
        self._thread: threading.Thread | None = None
        self._holder: dict[str, Any] = {}
        self._config_error: ShardMergeError | None = None
        self.config_dir: Path | None = None
        self.raw_config: dict | None = None
        self._tmpdirs: list[Path] = []
        self.synth_note: str | None = None

    # -- the expected model -------------------------------------------------------------------------------
    def start_expected(self, use_child: bool = False) -> None:
        try:
            self.config_dir = find_config_dir(self.loc.path, self.cfg.hf_model_config_path)
        except ConfigNotFoundError as e:
            self.config_dir = self._synthesized_config(e)
            if self.config_dir is None:
                self._config_error = e
                return
        try:
            raw = json.loads((self.config_dir / "config.json").read_text())
            self.raw_config = raw if isinstance(raw, dict) else None
        except (OSError, ValueError):
            self.raw_config = None  # load_config reports it with the file name

        cached = None if self.cfg.trust_remote_code else cached_expected(self.config_dir, self.cfg.is_value_model)
        if cached is not None and not cached.has_conversion:
            self.exp = cached
            return

        in_child = use_child and not self.cfg.trust_remote_code and not _moe_like(self.raw_config)

        def build() -> None:
            try:
                exp = None
                if in_child:
                    try:
                        exp = expected_via_subprocess(self.config_dir, self.cfg.is_value_model)
                    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                        log.debug("expected-model helper process failed (%s); building in-process", e)
                if exp is None:
                    exp = build_expected(self.config_dir, self.cfg.trust_remote_code, self.cfg.is_value_model)
                    if not self.cfg.trust_remote_code:
                        store_expected(exp, self.cfg.is_value_model)
                self._holder["exp"] = exp
            except BaseException as e:  # re-raised in the caller's thread
                self._holder["err"] = e

        self._thread = threading.Thread(target=build, name="shardmerge-expected", daemon=True)
        self._thread.start()

    def _synthesized_config(self, not_found: ConfigNotFoundError) -> Path | None:  # noqa: ARG002
        """Megatron checkpoints without an HF config: one written from the Megatron arguments they record."""
        if self.loc.backend != "megatron" or self.cfg.hf_model_config_path:
            return None
        from .convert.megatron import synthesize_config
        from .formats.megatron import read_args

        args = read_args(self.loc.path, self.cfg.trust_pickle)
        if not args:
            return None
        import tempfile

        config = synthesize_config(args, str(self.loc.path))
        folder = Path(tempfile.mkdtemp(prefix="shardmerge-config-"))
        self._tmpdirs.append(folder)
        config.save_pretrained(str(folder))
        self.synth_note = (f"no HF config.json near the checkpoint: a {config.architectures[0]} config was synthesized "
                           "from the Megatron arguments (no tokenizer or generation config to copy)")
        return folder

    def expected_ready(self) -> bool:
        return (
            self.exp is not None
            or self._config_error is not None
            or (self._thread is not None and not self._thread.is_alive())
        )

    def expected(self) -> ExpectedModel:
        if self.exp is None:
            if self._config_error is not None:
                raise self._config_error
            self._thread.join()
            if "err" in self._holder:
                raise self._holder["err"]
            self.exp = self._holder["exp"]
        if self.exp.model is None and self.exp.has_conversion:
            # Converting fused layouts uses transformers' conversion rules, which need the model object.
            self.exp = build_expected(self.config_dir, self.cfg.trust_remote_code, self.cfg.is_value_model)
        return self.exp

    def oracle(self, name: str):
        exp = self.expected()
        n = strip_wrappers(name)
        if n in exp.in_memory:
            return exp.in_memory[n]
        i = n.find(".")
        while i != -1:
            if n[i + 1 :] in exp.in_memory:
                return exp.in_memory[n[i + 1 :]]
            i = n.find(".", i + 1)
        return None

    # -- planning -----------------------------------------------------------------------------------------
    def prepare(self, allow_speculation: bool = True) -> None:
        self.start_expected(use_child=allow_speculation)
        reader = open_reader(self.loc)
        self.ckpt = reader(self.loc.path, self.pool, self.oracle, trust_pickle=self.cfg.trust_pickle, check_replicas=self.cfg.check_replicas)
        spec = None
        if (allow_speculation and not self.expected_ready() and self.cfg.tie_word_embedding is None
                and self.ckpt.format != "megatron"):
            spec = speculate_hf_named(self.ckpt, self.raw_config)
        if spec is not None:
            self.speculative = True
            self._adopt(spec)
        else:
            self._adopt(convert(self.ckpt, self.expected(), self.cfg))
            self.confirmed = True

    def _adopt(self, converted: Converted) -> None:
        self.converted = converted
        self.notes = list(self.ckpt.notes) + ([self.synth_note] if self.synth_note else []) + converted.notes
        self.out = []
        narrowed: Counter = Counter()
        for name, src in converted.tensors.items():
            dt = output_dtype(self.cfg.dtype, src.dtype)
            if dt != src.dtype and src.dtype.itemsize > dt.itemsize:
                narrowed[(_dtype_name(src.dtype), _dtype_name(dt))] += 1
            self.out.append(OutTensor(name, src, dt))
        for (a, b), n in narrowed.items():
            self.notes.append(f"narrowing {a} -> {b} for {n} tensors (--dtype {self.cfg.dtype}; use --dtype source to keep {a})")
        self.files = plan_files(self.out, self.cfg.max_shard_bytes)
        self.adapter_files: list[PlannedFile] = []
        if converted.adapter is not None:
            tensors, _ = converted.adapter
            outs = [OutTensor(k, src, src.dtype) for k, src in tensors.items()]
            self.adapter_files = plan_files(outs, 1 << 62, pattern="adapter_model{suffix}.safetensors")

    def confirm(self) -> bool:
        """Check a speculative plan against the exact conversion; adopt the exact one if they differ.

        Returns:
            True when the plan already written stands; False when it was replaced (write again).

        Raises:
            ConversionError etc.: the exact conversion fails (the checkpoint does not fit the model).
        """
        if self.confirmed:
            return True
        exact = convert(self.ckpt, self.expected(), self.cfg)
        self.confirmed = True
        if same_plan(exact, self.converted):
            self.notes = list(self.ckpt.notes) + exact.notes + [n for n in self.notes if n.startswith("narrowing")]
            return True
        log.info("%s: the plan made before the model check differs from the exact one; writing again", self.loc.path.name)
        self._adopt(exact)
        return False

    def close(self) -> None:
        self.pool.close()
        import shutil

        for d in self._tmpdirs:
            shutil.rmtree(d, ignore_errors=True)


def _moe_like(raw: dict | None) -> bool:
    """Configs whose in-memory layout differs from the on-disk one (fused experts) need the model object."""
    if not raw:
        return False
    keys = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
    return any(raw.get(k) for k in keys) or any((raw.get("text_config") or {}).get(k) for k in keys)


def _prepare(loc: Located, cfg: MergeConfig, allow_speculation: bool = False) -> _Plan:
    plan = _Plan(loc, cfg)
    try:
        plan.prepare(allow_speculation)
        return plan
    except BaseException:
        plan.close()
        raise


def _block_bytes(cfg: MergeConfig, workers: int) -> int:
    # Each worker thread owns a source buffer (one block) and a cast buffer (at most one block).
    per = cfg.memory_budget_bytes // (workers * 2)
    return int(min(max(per, 4096), 512 << 20))


def _workers(cfg: MergeConfig) -> int:
    return cfg.workers or min(4, os.cpu_count() or 1)


def _report_from(prep: _Plan, started: float) -> MergeReport:
    ckpt, exp, loc = prep.ckpt, prep.expected(), prep.loc
    out_dtypes = Counter(_dtype_name(t.dtype) for t in prep.out if t.dtype.is_floating_point)
    return MergeReport(
        source=str(loc.path),
        format=ckpt.format,
        reason=loc.reason,
        discovery=list(loc.chain),
        role=loc.role,
        step=loc.step if loc.step is not None else ckpt.step,
        world_size=ckpt.world_size,
        mesh=ckpt.mesh,
        placements=dict(ckpt.placements),
        config_dir=str(exp.config_dir) if exp.config_dir else None,
        architecture=exp.architecture,
        tie_word_embeddings=exp.tie_word_embeddings,
        dtype=out_dtypes.most_common(1)[0][0] if out_dtypes else None,
        source_dtypes=dict(Counter(_dtype_name(t.source.dtype) for t in prep.out)),
        tensors=len(prep.out),
        bytes=sum(t.nbytes for t in prep.out),
        files=[f.name for f in prep.files],
        notes=list(prep.notes),
        seconds=time.perf_counter() - started,
    )


def _resolve_config(config: MergeConfig | None, overrides: dict[str, Any]) -> MergeConfig:
    cfg = config or MergeConfig()
    if overrides:
        cfg = cfg.replace(**overrides)
    if cfg.device != "cpu" and not torch.cuda.is_available():
        raise ShardMergeError(f"device {cfg.device!r} requested but CUDA is not available")
    if cfg.upload_repo:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(cfg.upload_repo)
        except HFValidationError as e:
            raise ShardMergeError(f"--hf-upload-path {cfg.upload_repo!r} is not a valid repository id ({str(e).splitlines()[0]})") from None
    return cfg


def inspect(local_dir: str | os.PathLike, config: MergeConfig | None = None, **overrides: Any) -> MergeReport:
    """Describe what :func:`merge` would do, from metadata only (nothing written, no tensor data read).

    The report holds the format and why, world size, mesh and placements, tensors and bytes, the planned files,
    the tie and dtype decisions and ``predicted_peak_bytes`` (resident memory the merge is expected to reach).

    Raises:
        ShardMergeError: as :func:`merge`, for everything found before writing.
    """
    import psutil

    started = time.perf_counter()
    cfg = _resolve_config(config, overrides)
    locs = locate(local_dir, cfg.backend, cfg.role)
    reports = []
    for loc in locs:
        prep = _prepare(loc, cfg)
        try:
            rep = _report_from(prep, started)
            workers = _workers(cfg)
            rep.predicted_peak_bytes = psutil.Process().memory_info().rss + workers * 2 * _block_bytes(cfg, workers)
            rep.planned = [{"file": f.name, "tensors": len(f.entries), "bytes": f.size} for f in prep.files]
            rep.target = str(default_target(loc.path, cfg.target, rep.step))
            reports.append(rep)
        finally:
            prep.close()
    return _combine(local_dir, reports)


def _combine(local_dir, reports: list[MergeReport]) -> MergeReport:
    if len(reports) == 1:
        return reports[0]
    top = MergeReport(source=str(local_dir), format=reports[0].format, reason="several roles")
    top.roles = {r.role or str(i): r for i, r in enumerate(reports)}
    top.tensors = sum(r.tensors for r in reports)
    top.bytes = sum(r.bytes for r in reports)
    top.seconds = max(r.seconds for r in reports)
    return top


def merge(
    local_dir: str | os.PathLike,
    target_dir: str | os.PathLike | None = None,
    config: MergeConfig | None = None,
    *,
    source_label: str | None = None,
    run: str | None = None,
    reserve_bytes: int = 0,
    **overrides: Any,
) -> MergeReport:
    """Merge a sharded checkpoint into a HuggingFace model directory.

    Args:
        local_dir: checkpoint folder or file, or a run root (``latest_checkpointed_iteration.txt``), or a verl step
            folder holding ``actor/`` and ``critic/`` (both merged, into ``target_dir/<role>``, unless ``role``).
        target_dir: output folder; default from ``config.target`` beside the source (``actor`` -> ``actor_hf``).
        config: options; ``overrides`` are :class:`MergeConfig` fields applied on top.
        source_label: the path recorded as ``source`` in the manifest (the background worker reads a pinned copy
            but records the path the trainer named).
        run: a run key recorded in the manifest (``keep_last`` only ever deletes folders of its own run).
        reserve_bytes: free space to leave on the target filesystem beyond the output (save time keeps room for
            the trainer's next checkpoint).

    Returns:
        a :class:`MergeReport` (with ``roles`` when several roles were merged).

    Raises:
        SourceError, UnsupportedSourceError, PickleRefusedError: bad or unsupported input (nothing written).
        ConfigNotFoundError, ConversionError, DtypeError: the HF side does not fit (nothing written).
        TargetError, DiskSpaceError: the target cannot be written.
        MergeInterrupted: SIGTERM during the merge (temporary output removed).
    """
    cfg = _resolve_config(config, overrides)
    _configure_logging(cfg)
    locs = locate(local_dir, cfg.backend, cfg.role)
    reports = []
    for loc in locs:
        if target_dir is not None:
            target = Path(target_dir) / loc.role if (len(locs) > 1 and loc.role) else Path(target_dir)
        else:
            target = default_target(loc.path, cfg.target, loc.step)
        label = source_label if (source_label and len(locs) == 1) else None
        reports.append(_merge_one(loc, target, cfg, label, run, reserve_bytes))
    rep = _combine(local_dir, reports)
    if len(reports) > 1 and target_dir is not None:
        rep.target = str(target_dir)
    if cfg.upload_repo:
        from .hub import upload

        upload(Path(rep.target), cfg.upload_repo, cfg.private)
    return rep


def _progress_enabled(cfg: MergeConfig) -> bool:
    if cfg.quiet:
        return False
    if cfg.progress is not None:
        return cfg.progress
    return sys.stderr.isatty()


def _configure_logging(cfg: MergeConfig) -> None:
    if cfg.quiet:
        log.setLevel(logging.WARNING)


def _merge_one(loc: Located, target: Path, cfg: MergeConfig, source_label: str | None = None, run: str | None = None,
               reserve_bytes: int = 0) -> MergeReport:
    started = time.perf_counter()
    staging = Staging(target, overwrite=cfg.overwrite, protected=[loc.path])
    staging.check_target()
    prep = _prepare(loc, cfg, allow_speculation=True)
    bar = None
    try:
        workers = _workers(cfg)
        block = _block_bytes(cfg, workers)
        stats = CastStats()
        if _progress_enabled(cfg):
            from tqdm import tqdm

            bar = tqdm(total=sum(t.nbytes for t in prep.out), unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"merging {loc.path.name}", file=sys.stderr)
        if cfg.device != "cpu":
            _limit_cuda(cfg.device, cfg.cuda_memory_fraction)

        def cancelled() -> bool:
            # Polled between blocks: once the expected model is ready, check a speculative plan.
            return prep.speculative and not prep.confirmed and prep.expected_ready() and not prep.confirm()

        with terminate_as_exception(), staging:
            staging.check_space(sum(f.size for f in prep.files + prep.adapter_files), reserve_bytes)
            while True:
                try:
                    write_files(prep.files, staging.tmp, workers, block, stats, bar.update if bar else None, cfg.device, cancelled)
                except WriteCancelled:
                    pass
                except OSError as e:
                    raise TargetError(f"writing {staging.target} failed: {e.strerror or e}; nothing was published") from None
                else:
                    if prep.confirm():
                        break
                _clear(staging.tmp)
                stats = CastStats()
                if bar is not None:
                    bar.reset(total=sum(t.nbytes for t in prep.out))
            if prep.converted.adapter is not None:
                adir = staging.tmp / "lora_adapter"
                adir.mkdir()
                write_files(prep.adapter_files, adir, workers, block, stats, None, cfg.device)
                prep.converted.adapter[1].save_pretrained(str(adir))
            rep = _report_from(prep, started)
            rep.target = str(staging.target)
            if source_label:
                rep.source = source_label
            for n in prep.notes:
                log.info("%s: %s", loc.path.name, n)
            if len(prep.files) > 1:
                write_json(staging.tmp / "model.safetensors.index.json", index_json(prep.files))
            exp = prep.expected()
            if exp.config_dir is not None:
                rep.copied = copy_hf_files(exp.config_dir, staging.tmp, cfg.trust_remote_code)
                updates = {"num_labels": 1} if cfg.is_value_model else None
                write_config(exp.config_dir, staging.tmp, rep.dtype or "float32", exp.architecture, updates)
                rep.copied.insert(0, "config.json")
            rep.nonfinite = {k: v for k, v in stats.nonfinite.items() if v}
            rep.seconds = time.perf_counter() - started
            write_json(staging.tmp / MANIFEST, _manifest(rep, prep, run))
            staging.publish()
        if rep.nonfinite:
            log.warning("%d tensors hold non-finite values (passed through): %s", len(rep.nonfinite), ", ".join(list(rep.nonfinite)[:5]))
        log.info("merged %s -> %s: %d tensors, %s in %.1f s", loc.path, target, rep.tensors, human_bytes(rep.bytes), rep.seconds)
        return rep
    finally:
        if bar is not None:
            bar.close()
        prep.close()


def _clear(folder: Path) -> None:
    for p in folder.iterdir():
        if p.name != OWNER_FILE:
            p.unlink()


def _limit_cuda(device: str, fraction: float) -> None:
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def _manifest(rep: MergeReport, prep: _Plan, run: str | None = None) -> dict:
    return {
        "schema_version": MANIFEST_SCHEMA,
        "source": rep.source,
        "run": run,
        "format": rep.format,
        "role": rep.role,
        "world_size": rep.world_size,
        "mesh": rep.mesh,
        "step": rep.step,
        "dtype": rep.dtype,
        "architecture": rep.architecture,
        "tensors": rep.tensors,
        "bytes": rep.bytes,
        "files": rep.files + ([] if len(rep.files) <= 1 else ["model.safetensors.index.json"])
        + (["lora_adapter/adapter_model.safetensors", "lora_adapter/adapter_config.json"] if prep.converted.adapter else []),
        "nonfinite": rep.nonfinite,
        "notes": rep.notes,
        # the options that decide what was written (verify re-merges a source with them)
        "options": {k: getattr(prep.cfg, k) for k in MANIFEST_OPTIONS},
        "seconds": round(rep.seconds, 3),
        "shardmerge_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
