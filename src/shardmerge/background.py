"""The background merge worker and its job queue (save-time merging).

Trainer side (:class:`MergeWorker`), in global rank 0 of the training job:

* :meth:`MergeWorker.submit` is called once a checkpoint is *completely* written. It pins the checkpoint by
  hard-linking its files into a private folder ``.shardmerge-pins/<job>/`` beside it (same filesystem), so the
  trainer's rotation may delete the checkpoint while it is merged; where hard links are impossible the job reads
  the original and fails cleanly if it disappears. It writes ``<target>.status.json`` (``queued``) and hands the job
  to the worker process, starting it on the first job. It never raises into training.
* :meth:`MergeWorker.close` waits for queued merges (``wait=True``, with a progress line) or leaves them to finish on
  their own (``wait=False``; the worker runs in its own session and exits when its queue is empty).

Worker side (``python -m shardmerge.background``): a separate interpreter that inherits nothing from the trainer (no
CUDA context, no process group, distributed environment variables removed) and never imports the training script.
It runs jobs in order at low priority (``nice``, few threads), records ``running`` / ``done`` / ``failed`` /
``superseded`` in each status file (a failure as one line), removes the pin when a job ends, applies ``supersede``
(a queued job is dropped when a newer one of the same run arrives) and ``keep_last`` (only folders carrying our
manifest and recorded as this run's are ever deleted), and refuses a merge that would leave less free space than
the checkpoint itself takes (the trainer's next save needs about that much).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import MergeConfig

log = logging.getLogger("shardmerge")

PIN_DIR = ".shardmerge-pins"
TERMINAL = ("done", "failed", "superseded", "removed")
# Environment of the trainer that must not reach the worker (it is no member of any process group).
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NODE_RANK")


def status_path(target: str | os.PathLike) -> Path:
    """``<target>.status.json`` beside the target folder."""
    t = Path(target)
    return t.parent / f"{t.name}.status.json"


def read_status(target: str | os.PathLike) -> dict | None:
    """The job status recorded for ``target``, or ``None``."""
    try:
        return json.loads(status_path(target).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_status(target: str | os.PathLike, /, **fields: Any) -> dict:
    """Update ``<target>.status.json`` atomically (fields merged into what is there)."""
    p = status_path(target)
    data = read_status(target) or {}
    data.update(fields)
    tmp = p.parent / f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, p)
    return data


def pin(source: Path) -> tuple[Path | None, str]:
    """Hard-link every file of ``source`` (a folder or a single file) into a private pin folder beside it.

    Returns:
        ``(pinned path, note)``; ``(None, why)`` when hard links are impossible (other filesystem, no permission).
    """
    root = source.parent / PIN_DIR / uuid.uuid4().hex[:12]
    try:
        root.mkdir(parents=True)
        dst = root / source.name
        if source.is_dir():
            for dirpath, _dirs, filenames in os.walk(source):
                rel = Path(dirpath).relative_to(source)
                (dst / rel).mkdir(parents=True, exist_ok=True)
                for name in filenames:
                    os.link(Path(dirpath) / name, dst / rel / name)
        else:
            os.link(source, dst)
        return dst, f"pinned with hard links in {root}"
    except OSError as e:
        shutil.rmtree(root, ignore_errors=True)
        _remove_empty(source.parent / PIN_DIR)
        return None, f"not pinned ({e.strerror or e}); the merge reads {source} directly"


def unpin(pinned: str | os.PathLike | None) -> None:
    if not pinned:
        return
    root = Path(pinned).parent
    if root.parent.name == PIN_DIR:
        shutil.rmtree(root, ignore_errors=True)
        _remove_empty(root.parent)


def _remove_empty(p: Path) -> None:
    try:
        p.rmdir()
    except OSError:
        pass


def _tree_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


@dataclass
class Job:
    """One submitted merge. ``source`` is the path the trainer named; ``pinned`` what the worker reads."""

    id: str
    source: str
    target: str
    run: str
    config: dict
    pinned: str | None = None
    hf_config_dir: str | None = None
    step: int | None = None
    submitted: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


class MergeWorker:
    """Trainer-side handle on one background worker process.

    Args:
        config: default :class:`MergeConfig` of the jobs (each submit may override fields).
        log_file: where the worker writes its log (default: a file in the temp folder, named in the log).
    """

    def __init__(self, config: MergeConfig | None = None, log_file: str | os.PathLike | None = None):
        self.config = config or MergeConfig()
        self.log_file = Path(log_file) if log_file else Path(tempfile.gettempdir()) / f"shardmerge-worker-{os.getpid()}.log"
        self.proc: subprocess.Popen | None = None
        self.jobs: list[Job] = []
        self._reported: set[str] = set()
        self._lock = threading.Lock()

    # -- submitting ----------------------------------------------------------------------------------------------
    def submit(
        self,
        source: str | os.PathLike,
        target: str | os.PathLike | None = None,
        run: str | None = None,
        step: int | None = None,
        hf_config_dir: str | os.PathLike | None = None,
        **overrides: Any,
    ) -> Job | None:
        """Queue a merge of a completely written checkpoint; returns the job, or ``None`` if it could not be queued
        (the reason is logged and, when the target is known, recorded in its status file). Never raises.

        Args:
            source: the checkpoint folder or file, as the trainer wrote it.
            target: output folder; default from the ``target`` template beside the source.
            run: jobs of one run share a key (``supersede`` and ``keep_last`` act within a run).
            hf_config_dir: folder holding the HF config/tokenizer when none is found near the checkpoint.
        """
        target_path = None
        pinned = None
        try:
            from .engine import default_target  # light: no torch import until the engine runs
            from .formats import step_of

            src = Path(source).resolve()
            step = step if step is not None else step_of(src)
            template = overrides.get("target", self.config.target)
            target_path = Path(target).resolve() if target else default_target(src, template, step)
            cfg = self.config.replace(**overrides) if overrides else self.config
            if not src.exists():
                raise FileNotFoundError(f"{src} does not exist")
            run = run or str(src.parent)
            job = Job(uuid.uuid4().hex[:12], str(src), str(target_path), run, cfg.to_dict(), step=step)
            job.hf_config_dir = self._config_dir(src, hf_config_dir, cfg)
            pinned, note = pin(src)
            if pinned is not None:
                job.pinned = str(pinned)
                if job.hf_config_dir and Path(job.hf_config_dir).is_relative_to(src):
                    job.hf_config_dir = str(pinned / Path(job.hf_config_dir).relative_to(src))
            write_status(target_path, state="queued", job=job.id, source=job.source, target=job.target, run=run,
                         step=step, error=None, submitted=job.submitted, started=None, finished=None, seconds=None,
                         pin=note)
            self._send({"op": "submit", "job": job.__dict__})
            with self._lock:
                self.jobs.append(job)
            log.info("shardmerge: queued merge of %s -> %s", src, target_path)
            return job
        except Exception as e:  # noqa: BLE001 - a failed submit must never stop training
            unpin(pinned)
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            log.error("shardmerge: could not queue the merge of %s: %s", source, msg)
            if target_path is not None:
                try:
                    write_status(target_path, state="failed", error=f"not queued: {msg}", finished=time.time())
                except OSError:
                    pass
            return None

    def _config_dir(self, src: Path, given, cfg: MergeConfig) -> str | None:
        if cfg.hf_model_config_path:
            return str(Path(cfg.hf_model_config_path).resolve())
        from .errors import ConfigNotFoundError
        from .formats import locate
        from .hfdir import find_config_dir

        try:
            loc = locate(src, cfg.backend, cfg.role)[0]
            return str(find_config_dir(loc.path))
        except ConfigNotFoundError:
            return str(Path(given).resolve()) if given else None
        except Exception:  # noqa: BLE001 - the worker reports source errors with full detail
            return str(Path(given).resolve()) if given else None

    def _send(self, msg: dict) -> None:
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env.setdefault("HF_HUB_OFFLINE", "1")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_file, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardmerge.background"],
            stdin=subprocess.PIPE,
            stdout=logf,
            stderr=logf,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,  # survives the trainer when wait_on_exit=False; gets no terminal signals
            close_fds=True,
        )
        logf.close()
        log.info("shardmerge: background worker started (pid %d, log %s)", self.proc.pid, self.log_file)

    # -- results -------------------------------------------------------------------------------------------------
    def statuses(self) -> list[dict]:
        """Current status of every submitted job (submission order)."""
        with self._lock:
            jobs = list(self.jobs)
        return [read_status(j.target) or {"state": "unknown", "target": j.target, "source": j.source} for j in jobs]

    def finished(self) -> list[dict]:
        """Statuses that became terminal since the last call (each returned once)."""
        out = []
        with self._lock:
            jobs = list(self.jobs)
        for j in jobs:
            if j.id in self._reported:
                continue
            st = read_status(j.target)
            if st and st.get("job") == j.id and st.get("state") in TERMINAL:
                self._reported.add(j.id)
                out.append(st)
        return out

    def pending(self) -> list[dict]:
        return [s for s in self.statuses() if s.get("state") not in TERMINAL]

    def wait(self, timeout: float | None = None, progress: bool = True, interval: float = 0.5) -> list[dict]:
        """Block until every submitted job is terminal (or ``timeout`` seconds); returns the statuses."""
        deadline = None if timeout is None else time.time() + timeout
        last_line = 0.0
        while True:
            pend = self.pending()
            if not pend:
                break
            if self.proc is not None and self.proc.poll() is not None and self._queue_lost(pend):
                break
            if deadline is not None and time.time() > deadline:
                break
            if progress and time.time() - last_line > 10:
                running = [Path(s.get("source", "?")).name for s in pend if s.get("state") == "running"]
                log.warning("shardmerge: waiting for %d merge(s)%s", len(pend), f" (running: {', '.join(running)})" if running else "")
                last_line = time.time()
            time.sleep(interval)
        return self.statuses()

    def _queue_lost(self, pend: list[dict]) -> bool:
        # The worker exited with jobs not terminal: record them as failed so nobody waits forever.
        for s in self.pending():
            if s.get("state") in ("queued", "running"):
                write_status(s["target"], state="failed", error=f"the worker exited (code {self.proc.returncode}) before this job ended; see {self.log_file}", finished=time.time())
        return True

    def close(self, wait: bool = True, timeout: float | None = None) -> list[dict]:
        """No more jobs: with ``wait``, block until queued merges end; else leave them to the worker."""
        with self._lock:
            proc = self.proc
        if proc is not None and proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        if wait and proc is not None:
            out = self.wait(timeout=timeout)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            return out
        return self.statuses()


# -- worker process -------------------------------------------------------------------------------------------------


def _keep_last(job: Job, n: int) -> list[str]:
    """Delete this run's older merged folders beyond the ``n`` newest; only folders whose manifest names this run."""
    from .hfdir import read_manifest

    t = Path(job.target)
    candidates = {p for p in t.parent.iterdir() if p.is_dir()}
    candidates |= {p for p in t.parent.parent.glob(f"*/{t.name}") if p.is_dir()}
    ours = []
    for p in candidates:
        m = read_manifest(p)
        if m and m.get("run") == job.run:
            ours.append((m.get("step") if m.get("step") is not None else -1, m.get("created", ""), p))
    ours.sort(key=lambda x: (x[0], x[1]))
    removed = []
    for _, _, p in ours[: max(0, len(ours) - n)]:
        if p == t:
            continue
        shutil.rmtree(p, ignore_errors=True)
        if status_path(p).exists():
            write_status(p, state="removed", error=None, removed_by=f"keep_last={n} after {job.target}", finished=time.time())
        removed.append(str(p))
    return removed


def run_job(job: Job) -> None:
    """Run one job in this process: status running, merge from the pin, status done/failed, unpin. Never raises."""
    from .engine import merge
    from .errors import ShardMergeError

    cfg = MergeConfig.from_mapping(job.config)
    overrides: dict[str, Any] = {"quiet": True, "progress": False}
    if job.hf_config_dir and not cfg.hf_model_config_path:
        overrides["hf_model_config_path"] = job.hf_config_dir
    started = time.time()
    write_status(job.target, state="running", started=started, worker_pid=os.getpid())
    read_from = Path(job.pinned) if job.pinned else Path(job.source)
    try:
        if not read_from.exists():
            raise FileNotFoundError(f"{job.source} was removed before its merge started")
        rep = merge(read_from, job.target, cfg.replace(**overrides), source_label=job.source, run=job.run,
                    reserve_bytes=_tree_bytes(read_from))
        removed = _keep_last(job, cfg.keep_last) if cfg.keep_last else []
        write_status(job.target, state="done", error=None, finished=time.time(), seconds=round(time.time() - started, 3),
                     bytes=rep.bytes, tensors=rep.tensors, files=rep.files, removed=removed)
        log.info("done %s -> %s (%.1f s)", job.source, job.target, time.time() - started)
    except (ShardMergeError, OSError, Exception) as e:  # noqa: BLE001 - every failure is recorded, none escapes
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, ShardMergeError) else str(e)
        if not Path(job.source).exists() and not job.pinned:
            msg = f"the checkpoint was removed while it was merged ({msg})"
        write_status(job.target, state="failed", error=" ".join(msg.split()), finished=time.time(),
                     seconds=round(time.time() - started, 3))
        log.error("failed %s: %s", job.source, msg)
    finally:
        unpin(job.pinned)


def worker_main() -> int:
    """Entry point of the worker process: read jobs (JSON lines) on stdin, run them in order."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s shardmerge-worker[%(process)d] %(message)s")
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        import torch

        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    except Exception:  # noqa: BLE001
        pass
    sys.setswitchinterval(0.0005)
    inbox: queue.Queue = queue.Queue()

    def reader() -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                inbox.put(json.loads(line))
            except json.JSONDecodeError:
                log.error("ignoring a malformed message: %r", line[:200])
        inbox.put({"op": "eof"})

    threading.Thread(target=reader, daemon=True).start()
    pending: list[Job] = []
    closing = False
    while True:
        # Take everything that has arrived (waiting only when idle), apply supersede, then run the next job.
        msgs = []
        try:
            if not pending and not closing:
                msgs.append(inbox.get())
            while True:
                msgs.append(inbox.get_nowait())
        except queue.Empty:
            pass
        for msg in msgs:
            op = msg.get("op")
            if op == "submit":
                job = Job(**msg["job"])
                if MergeConfig.from_mapping(job.config).supersede:
                    for old in [p for p in pending if p.run == job.run]:
                        pending.remove(old)
                        write_status(old.target, state="superseded", finished=time.time(),
                                     error=f"superseded by the newer checkpoint {job.source}")
                        unpin(old.pinned)
                pending.append(job)
            elif op in ("close", "eof"):
                closing = True
        if pending:
            run_job(pending.pop(0))
        elif closing:
            return 0


if __name__ == "__main__":
    raise SystemExit(worker_main())
