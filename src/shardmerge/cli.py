"""The ``shardmerge`` command: ``merge | inspect | verify | test | watch``.

verl's ``model_merger`` spellings are accepted as aliases (``--local_dir``, ``--target_dir``,
``--hf_model_config_path``, ``--hf_upload_path``, ``--private``, ``--trust-remote-code``, ``--tie-word-embedding``,
``--is-value-model``; ``--use_cpu_initialization`` is accepted and has nothing to do here). Errors are printed as one
line, the last on stderr, and the exit code says what happened (see :mod:`shardmerge.errors`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from .config import BACKENDS, DTYPE_ALIASES, DTYPES, LORA_MODES, MergeConfig, field_help, human_bytes
from .errors import ShardMergeError

HELP = field_help()


def _add_source_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("source", nargs="?", help="checkpoint folder/file or run root (same as --local-dir)")
    p.add_argument("--local-dir", "--local_dir", dest="local_dir", help="checkpoint folder/file or run root")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help=HELP["backend"])
    p.add_argument("--role", help=HELP["role"])
    p.add_argument("--hf-model-config-path", "--hf_model_config_path", dest="hf_model_config_path", help=HELP["hf_model_config_path"])
    p.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true", help=HELP["trust_remote_code"])
    p.add_argument("--trust-pickle", dest="trust_pickle", action="store_true", help=HELP["trust_pickle"])
    p.add_argument("--tie-word-embedding", "--tie_word_embedding", dest="tie_word_embedding", action="store_const", const=True, default=None, help=HELP["tie_word_embedding"])
    p.add_argument("--no-tie-word-embedding", dest="tie_word_embedding", action="store_const", const=False, help="assert the embedding and lm_head are not tied")
    p.add_argument("--is-value-model", "--is_value_model", dest="is_value_model", action="store_true", help=HELP["is_value_model"])
    p.add_argument("--use_cpu_initialization", "--use-cpu-initialization", dest="use_cpu_initialization", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", type=_dtype_arg, default="bfloat16", help=HELP["dtype"])
    p.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default="5GB", help=HELP["max_shard_size"])
    p.add_argument("--memory-budget", dest="memory_budget", default="256MiB", help=HELP["memory_budget"])
    p.add_argument("--workers", type=int, default=0, help=HELP["workers"])
    p.add_argument("--device", default="cpu", help=HELP["device"])
    p.add_argument("--no-check-replicas", dest="check_replicas", action="store_false", help="do not compare replicated pieces")
    p.add_argument("--lora", choices=LORA_MODES, default="auto", help=HELP["lora"])
    p.add_argument("--lora-r", dest="lora_r", type=int, help=HELP["lora_r"])
    p.add_argument("--lora-alpha", dest="lora_alpha", type=float, help=HELP["lora_alpha"])
    p.add_argument("--lora-rslora", dest="lora_rslora", action="store_const", const=True, default=None, help=HELP["lora_rslora"])
    p.add_argument("--base-model-path", dest="base_model_path", help=HELP["base_model_path"])
    p.add_argument("--keep-mtp", dest="keep_mtp", action="store_true", help=HELP["keep_mtp"])
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help=HELP["quiet"])
    p.add_argument("--progress", dest="progress", action="store_const", const=True, default=None, help="always show the progress bar")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, help="never show the progress bar")


CONFIG_ARGS = (
    "backend", "role", "hf_model_config_path", "trust_remote_code", "trust_pickle", "tie_word_embedding",
    "is_value_model", "dtype", "max_shard_size", "memory_budget", "workers", "device", "check_replicas", "lora",
    "lora_r", "lora_alpha", "lora_rslora", "base_model_path", "keep_mtp", "quiet", "progress",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardmerge",
        description="Merge sharded training checkpoints into HuggingFace model directories.",
        epilog="exit codes: 0 ok, 1 error (one line on stderr), 2 usage, 3 verify/test found differences, 130 interrupted",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    parser._subparsers_by_name = sub.choices  # for errors reported with the subcommand's usage

    m = sub.add_parser("merge", help="merge a checkpoint into a HF directory")
    _add_source_args(m)
    m.add_argument("--target-dir", "--target_dir", dest="target_dir", help="output folder (default: <checkpoint>_hf beside it)")
    m.add_argument("--overwrite", action="store_true", help=HELP["overwrite"])
    m.add_argument("--hf-upload-path", "--hf_upload_path", dest="upload_repo", help=HELP["upload_repo"])
    m.add_argument("--private", action="store_true", help=HELP["private"])

    i = sub.add_parser("inspect", help="describe a checkpoint and the merge plan (metadata only)")
    _add_source_args(i)

    v = sub.add_parser("verify", help="compare two HF directories, or a merged directory with its source checkpoint")
    v.add_argument("a", help="HF directory (or checkpoint)")
    v.add_argument("b", help="HF directory or checkpoint to compare with")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--trust-pickle", dest="trust_pickle", action="store_true", help=HELP["trust_pickle"])
    v.add_argument("--quiet", "-q", action="store_true", help=HELP["quiet"])

    t = sub.add_parser("test", help="merge to a temporary folder in the reference's dtype and compare (verl's `test`)")
    _add_source_args(t)
    t.add_argument("--test-hf-dir", "--test_hf_dir", dest="test_hf_dir", required=True, help="reference HF directory")

    w = sub.add_parser("watch", help="merge each newly completed checkpoint under a root")
    w.add_argument("root", help="folder to follow")
    w.add_argument("--once", action="store_true", help="merge what is complete now, then exit")
    w.add_argument("--interval", type=float, default=10.0, help="seconds between scans")
    w.add_argument("--target", default="{stem}_hf", help=HELP["target"])
    w.add_argument("--dtype", type=_dtype_arg, default="bfloat16", help=HELP["dtype"])
    w.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default="5GB", help=HELP["max_shard_size"])
    w.add_argument("--hf-model-config-path", "--hf_model_config_path", dest="hf_model_config_path", help=HELP["hf_model_config_path"])
    w.add_argument("--keep-last", dest="keep_last", type=int, help=HELP["keep_last"])
    w.add_argument("--trust-pickle", dest="trust_pickle", action="store_true", help=HELP["trust_pickle"])
    w.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true", help=HELP["trust_remote_code"])
    w.add_argument("--json", action="store_true", help="print one JSON line per merge")
    w.add_argument("--quiet", "-q", action="store_true", help=HELP["quiet"])
    return parser


def config_from_args(args: argparse.Namespace) -> MergeConfig:
    values: dict[str, Any] = {k: getattr(args, k) for k in CONFIG_ARGS if hasattr(args, k)}
    for k in ("overwrite", "upload_repo", "private", "target", "keep_last"):
        if hasattr(args, k):
            values[k] = getattr(args, k)
    return MergeConfig.from_mapping(values)


def _source(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    src = args.local_dir or getattr(args, "source", None)
    if getattr(args, "source", None) and args.local_dir and args.source != args.local_dir:
        parser.error("give the checkpoint either positionally or with --local-dir, not both")
    if not src:
        parser.error("the checkpoint path is required (positional or --local-dir)")
    return src


def _setup_logging(quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("shardmerge: %(message)s"))
    log = logging.getLogger("shardmerge")
    log.handlers[:] = [handler]
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    log.propagate = False


def _dtype_arg(text: str) -> str:
    value = DTYPE_ALIASES.get(text.lower(), text.lower())
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DTYPES)} (or bf16, fp16, fp32)")
    return value


def _print_report(rep, command: str) -> None:
    if rep.roles:
        for role, r in rep.roles.items():
            print(f"== role {role}")
            _print_report(r, command)
        return
    rows = [
        ("source", rep.source),
        ("format", f"{rep.format} ({rep.reason})"),
    ]
    if rep.discovery:
        rows.append(("found by", "; ".join(rep.discovery)))
    rows += [
        ("world size", str(rep.world_size)),
        ("mesh", rep.mesh or "-"),
        ("placements", ", ".join(f"{k} x{v}" for k, v in rep.placements.items()) or "-"),
        ("config", f"{rep.config_dir} ({rep.architecture})"),
        ("tied embeddings", str(rep.tie_word_embeddings).lower()),
        ("dtype", f"{rep.dtype} (source: {', '.join(f'{k} x{v}' for k, v in rep.source_dtypes.items())})"),
        ("tensors", f"{rep.tensors}, {human_bytes(rep.bytes)}"),
        ("files", ", ".join(rep.files)),
    ]
    if command == "inspect":
        rows.append(("target", rep.target or "-"))
        rows.append(("predicted peak memory", human_bytes(rep.predicted_peak_bytes)))
    else:
        rows.append(("target", rep.target or "-"))
        rows.append(("seconds", f"{rep.seconds:.2f}"))
    for n in rep.notes:
        rows.append(("note", n))
    if rep.nonfinite:
        rows.append(("non-finite", ", ".join(f"{k}: {v}" for k, v in rep.nonfinite.items())))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    import signal
    import traceback

    from .writer import MergeInterrupted

    def on_term(signum, frame):
        raise MergeInterrupted("interrupted (SIGTERM); temporary output removed")

    signal.signal(signal.SIGTERM, on_term)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        (parser._subparsers_by_name.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 2
    _setup_logging(getattr(args, "quiet", False))
    # I/O threads hand the GIL back and forth around every read, cast and write; a short switch interval keeps
    # them from waiting behind Python-heavy work (imports, model building) in other threads of this process.
    sys.setswitchinterval(0.0005)
    try:
        return _dispatch(args, parser)
    except MergeInterrupted as e:
        print(f"shardmerge: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("shardmerge: interrupted (SIGINT); temporary output removed", file=sys.stderr)
        return 130
    except ShardMergeError as e:
        print(f"shardmerge: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - a bug: still one line, the traceback on request
        if os.environ.get("SHARDMERGE_DEBUG"):
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"shardmerge: internal error: {type(e).__name__}: {first} (please report it; SHARDMERGE_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> MergeConfig:
    try:
        return config_from_args(args)
    except ShardMergeError as e:  # an invalid option value is a usage error (exit 2)
        (parser._subparsers_by_name.get(args.command) or parser).error(str(e))
        raise


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command in ("merge", "inspect"):
        from . import engine

        src = _source(args, parser)
        cfg = _config(args, parser)
        if args.command == "merge":
            rep = engine.merge(src, args.target_dir, cfg)
        else:
            rep = engine.inspect(src, cfg)
        if args.json:
            print(json.dumps(rep.to_dict(), indent=2))
        elif not (args.command == "merge" and args.quiet):
            _print_report(rep, args.command)
        return 0
    if args.command == "verify":
        from .verify import print_verify, verify

        rep = verify(args.a, args.b, trust_pickle=args.trust_pickle)
        if args.json:
            print(json.dumps(rep.to_dict(), indent=2))
        else:
            print_verify(rep)
        return 0 if rep.ok else 3
    if args.command == "test":
        from .verify import merge_and_compare, print_verify

        src = _source(args, parser)
        rep = merge_and_compare(src, args.test_hf_dir, _config(args, parser))
        if args.json:
            print(json.dumps(rep.to_dict(), indent=2))
        else:
            print_verify(rep)
        return 0 if rep.ok else 3
    if args.command == "watch":
        from .watch import run_watch

        return run_watch(args)
    parser.error(f"unknown command {args.command}")
    return 2
