"""Bad input: one-line errors naming the file and what is wrong, nothing left behind, the source untouched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

import ckpt_writers
import shardmerge
from conftest import leftovers


def digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def fails(src, tmp_path, exc, match, **kw):
    before = digest(src) if src.exists() else {}
    out = tmp_path / "out"
    with pytest.raises(exc, match=match) as info:
        shardmerge.merge(src, out, quiet=True, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    assert not out.exists()
    assert leftovers(tmp_path) == []
    if before:
        assert digest(src) == before, "the source checkpoint was modified"
    return msg


def test_missing_rank_file(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w4_qwen2") / "actor"
    (actor / "model_world_size_4_rank_2.pt").unlink()
    msg = fails(actor, tmp_path, shardmerge.SourceError, "missing")
    assert "model_world_size_4_rank_2.pt" in msg


def test_truncated_rank_file(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    p = actor / "model_world_size_2_rank_1.pt"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    msg = fails(actor, tmp_path, shardmerge.SourceError, "truncated")
    assert "model_world_size_2_rank_1.pt" in msg


def test_garbage_rank_file(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    (actor / "model_world_size_2_rank_0.pt").write_bytes(b"not a zip at all")
    msg = fails(actor, tmp_path, shardmerge.SourceError, "model_world_size_2_rank_0.pt")
    assert "not a torch.save zip" in msg


def test_short_storage_record_inside_valid_zip(ckpt_copy, tmp_path):
    """A zip whose tensor record holds fewer bytes than its storage needs: named, nothing written."""
    import zipfile

    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    p = actor / "model_world_size_2_rank_1.pt"
    with zipfile.ZipFile(p) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    biggest = max((n for n, _ in entries if "/data/" in n), key=lambda n: len(dict(entries)[n]))
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries:
            z.writestr(name, data[: len(data) // 2] if name == biggest else data)
    msg = fails(actor, tmp_path, shardmerge.SourceError, "model_world_size_2_rank_1.pt")
    assert "expected" in msg and biggest.split("/", 1)[1] in msg


def test_mixed_world_sizes(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    shutil.copyfile(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_4_rank_0.pt")
    msg = fails(actor, tmp_path, shardmerge.SourceError, "several world sizes")
    assert "model_world_size_4_rank_0.pt" in msg


def test_fsdp_config_contradiction(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 8}))
    msg = fails(actor, tmp_path, shardmerge.SourceError, "world_size=8")
    assert "fsdp_config.json" in msg


def test_unreadable_rank_file(ckpt_copy, tmp_path):
    """A rank file that cannot be read (here a folder in its place; permissions do not stop root)."""
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    p = actor / "model_world_size_2_rank_1.pt"
    p.unlink()
    p.mkdir()
    fails(actor, tmp_path, shardmerge.SourceError, "model_world_size_2_rank_1.pt")


class Foreign:
    """Not on the allow-list: a rank file holding one is refused unless --trust-pickle."""

    def __init__(self):
        self.x = 1


def test_foreign_pickle_refused_then_trusted(tmp_path):
    src = tmp_path / "ckpt"
    sd = ckpt_writers.write_single(src, "llama")
    torch.save({**sd, "extra_object": Foreign()}, src / "model_world_size_1_rank_0.pt")
    msg = fails(src, tmp_path, shardmerge.PickleRefusedError, "refusing to unpickle")
    assert "test_errors.Foreign" in msg and "model_world_size_1_rank_0.pt" in msg and "--trust-pickle" in msg
    rep = shardmerge.merge(src, tmp_path / "trusted", quiet=True, trust_pickle=True)
    assert rep.tensors == len(sd)
    assert any("non-tensor" in n for n in rep.notes)


def test_code_execution_pickle_refused(tmp_path):
    """A pickle that would call os.system is refused before anything runs."""
    import pickle
    import zipfile

    src = tmp_path / "ckpt"
    ckpt_writers.write_single(src, "llama")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = src / "model_world_size_1_rank_0.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}, protocol=2))
        z.writestr("archive/byteorder", "little")
    msg = fails(src, tmp_path, shardmerge.PickleRefusedError, "posix.system|os.system")
    assert not marker.exists()
    assert "model_world_size_1_rank_0.pt" in msg


def test_megatron_folder_recognised(tmp_path):
    src = tmp_path / "iter_0000010"
    src.mkdir()
    (src / "metadata.json").write_text("{}")
    torch.save({}, src / "common.pt")
    with pytest.raises(shardmerge.ShardMergeError, match="Megatron"):
        shardmerge.merge(src, tmp_path / "out", quiet=True, backend="fsdp")


def test_no_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(shardmerge.SourceError, match="no checkpoint found"):
        shardmerge.merge(tmp_path / "empty", tmp_path / "out", quiet=True)
    with pytest.raises(shardmerge.SourceError, match="does not exist"):
        shardmerge.merge(tmp_path / "nope", tmp_path / "out", quiet=True)


def test_missing_config_lists_places(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    shutil.rmtree(actor / "huggingface")
    msg = fails(actor, tmp_path, shardmerge.ConfigNotFoundError, "no HF config.json found")
    assert str(actor / "huggingface" / "config.json") in msg and "--hf-model-config-path" in msg


def test_source_errors_come_before_config_errors(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    shutil.rmtree(actor / "huggingface")
    (actor / "model_world_size_2_rank_1.pt").unlink()
    fails(actor, tmp_path, shardmerge.SourceError, "missing")


def test_unknown_model_type(tmp_path):
    src = tmp_path / "ckpt"
    ckpt_writers.write_single(src, "llama")
    cfg = json.loads((src / "huggingface" / "config.json").read_text())
    cfg["model_type"] = "no_such_model_xyz"
    (src / "huggingface" / "config.json").write_text(json.dumps(cfg))
    msg = fails(src, tmp_path, shardmerge.ConversionError, "no_such_model_xyz")
    assert "config.json" in msg


def test_key_set_mismatch_lists_keys(tmp_path):
    src = tmp_path / "ckpt"
    sd = ckpt_writers.write_single(src, "llama")
    sd = dict(sd)
    sd.pop("model.norm.weight")
    sd["model.extra_head.weight"] = torch.zeros(3)
    torch.save(sd, src / "model_world_size_1_rank_0.pt")
    msg = fails(src, tmp_path, shardmerge.ConversionError, "key set does not match")
    assert "missing 1 key(s): model.norm.weight" in msg and "unexpected 1 key(s): model.extra_head.weight" in msg


def test_shape_mismatch(tmp_path):
    src = tmp_path / "ckpt"
    sd = dict(ckpt_writers.write_single(src, "llama"))
    sd["model.norm.weight"] = torch.ones(31)
    torch.save(sd, src / "model_world_size_1_rank_0.pt")
    fails(src, tmp_path, shardmerge.ConversionError, r"model.norm.weight \[31\] vs expected \[32\]")


def test_tied_config_with_different_lm_head(tmp_path):
    src = tmp_path / "ckpt"
    sd = dict(ckpt_writers.write_single(src, "qwen2"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone() + 1.0
    torch.save(sd, src / "model_world_size_1_rank_0.pt")
    msg = fails(src, tmp_path, shardmerge.ConversionError, "trained values differ")
    assert "lm_head.weight" in msg and "tie_word_embeddings" in msg


def test_plain_tensors_of_unclassifiable_shape(tmp_path):
    """W=2 plain files whose shapes are neither replicas nor dim-0 shards: named in the error."""
    src = tmp_path / "ckpt"
    sd = dict(ckpt_writers.write_single(src, "llama", world=2))
    sd1 = {k: v.clone() for k, v in sd.items()}
    sd1["model.norm.weight"] = torch.ones(5)
    torch.save(sd1, src / "model_world_size_2_rank_1.pt")
    msg = fails(src, tmp_path, shardmerge.SourceError, "model.norm.weight")
    assert "[32]" in msg.replace("(32,)", "[32]") or "32" in msg


def test_target_inside_source_refused(fsdp_ckpts, tmp_path):
    src = fsdp_ckpts / "fsdp2_w2_llama" / "actor"
    with pytest.raises(shardmerge.TargetError, match="overlaps the source"):
        shardmerge.merge(src, src / "hf", quiet=True)
    with pytest.raises(shardmerge.TargetError, match="overlaps the source"):
        shardmerge.merge(src, src, quiet=True)
    assert not (src / "hf").exists()


def test_existing_target_needs_overwrite(fsdp_ckpts, tmp_path):
    src = fsdp_ckpts / "fsdp2_w2_llama" / "actor"
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(shardmerge.TargetError, match="--overwrite"):
        shardmerge.merge(src, out, quiet=True)
    assert (out / "keep.txt").read_text() == "user data"
    shardmerge.merge(src, out, quiet=True, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "shardmerge.json").exists()
    assert leftovers(tmp_path) == []
    # An empty existing folder is simply filled.
    empty = tmp_path / "empty"
    empty.mkdir()
    shardmerge.merge(src, empty, quiet=True)
    assert (empty / "model.safetensors").exists()


def test_stale_partial_removed_live_one_refused(fsdp_ckpts, tmp_path):
    src = fsdp_ckpts / "fsdp2_w2_llama" / "actor"
    out = tmp_path / "out"
    # A dead process's temporary folder (pid beyond pid_max) is removed.
    stale = tmp_path / ".out.partial-999999999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"junk")
    shardmerge.merge(src, out, quiet=True)
    assert not stale.exists() and (out / "shardmerge.json").exists()
    # A live process's temporary folder makes the merge refuse.
    live = tmp_path / f".out2.partial-{os.getppid()}"
    live.mkdir()
    (live / ".shardmerge-owner").write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": os.getppid()}))
    with pytest.raises(shardmerge.TargetError, match="being written by another process"):
        shardmerge.merge(src, tmp_path / "out2", quiet=True)
    assert live.exists() and not (tmp_path / "out2").exists()


def test_disk_space_preflight(fsdp_ckpts, tmp_path, monkeypatch):
    import shutil as sh

    real = sh.disk_usage

    def tiny(path):
        u = real(path)
        return type(u)(u.total, u.total - 1000, 1000)

    monkeypatch.setattr("shardmerge.writer.shutil.disk_usage", tiny)
    msg = fails(fsdp_ckpts / "fsdp2_w2_llama" / "actor", tmp_path, shardmerge.DiskSpaceError, "not enough disk space")
    assert "GB needed" in msg


def test_failure_mid_write_leaves_nothing(fsdp_ckpts, tmp_path, monkeypatch):
    from shardmerge import writer

    calls = {"n": 0}
    real = writer._pwrite_all

    def flaky(fd, data, off):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        real(fd, data, off)

    monkeypatch.setattr(writer, "_pwrite_all", flaky)
    with pytest.raises(shardmerge.TargetError, match="No space left on device"):
        shardmerge.merge(fsdp_ckpts / "fsdp2_w2_llama" / "actor", tmp_path / "out", quiet=True, workers=1)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_single_rank_file_of_sharded_checkpoint(fsdp_ckpts, tmp_path):
    f = fsdp_ckpts / "fsdp2_w2_llama" / "actor" / "model_world_size_2_rank_0.pt"
    with pytest.raises(shardmerge.SourceError, match="one rank's file of a 2-rank FSDP checkpoint; point at the folder"):
        shardmerge.inspect(f)
    # the same shards under another file name: refused by the single-file reader
    other = tmp_path / "model.pt"
    shutil.copyfile(f, other)
    fails(other, tmp_path, shardmerge.SourceError, "DTensor shards .* one rank's piece of a sharded checkpoint")


def test_malformed_json_files(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    cfg = actor / "huggingface" / "config.json"
    good = cfg.read_text()
    for text in ("[1, 2]", "null", '"x"'):
        cfg.write_text(text)
        fails(actor, tmp_path, shardmerge.ConversionError, "expected an object")
    cfg.write_text(good)
    for text, match in (('{"world_size": "two"}', "world_size is 'two'"), ("[]", "holds a JSON list"), ('{"world_size": 2.5}', "world_size is 2.5")):
        (actor / "fsdp_config.json").write_text(text)
        fails(actor, tmp_path, shardmerge.SourceError, match)


def test_unwritable_target_parent(fsdp_ckpts, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(shardmerge.TargetError, match="cannot write in .*file"):
        shardmerge.merge(fsdp_ckpts / "fsdp2_w2_llama" / "actor", blocker / "out", quiet=True)


def test_symlinked_targets(fsdp_ckpts, tmp_path):
    src = fsdp_ckpts / "fsdp2_w2_llama" / "actor"
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    rep = shardmerge.merge(src, link, quiet=True)
    assert rep.target == str(real) and (real / "model.safetensors").exists() and link.is_symlink()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "elsewhere")
    shardmerge.merge(src, dangling, quiet=True)
    assert (tmp_path / "elsewhere" / "shardmerge.json").exists() and dangling.is_symlink()
    shardmerge.merge(src, link, quiet=True, overwrite=True, dtype="float32")
    assert link.is_symlink() and json.loads((real / "config.json").read_text())["dtype"] == "float32"
    assert leftovers(tmp_path) == []


def test_dot_source_gets_a_named_target(fsdp_ckpts, monkeypatch):
    monkeypatch.chdir(fsdp_ckpts / "fsdp2_w2_llama" / "actor")
    assert shardmerge.inspect(".").target == str(fsdp_ckpts / "fsdp2_w2_llama" / "actor_hf")
    monkeypatch.chdir(fsdp_ckpts / "fsdp2_w2_llama" / "actor" / "huggingface")
    assert shardmerge.inspect("..").target == str(fsdp_ckpts / "fsdp2_w2_llama" / "actor_hf")


def test_invalid_upload_repo_refused_before_merging(fsdp_ckpts, tmp_path):
    with pytest.raises(shardmerge.ShardMergeError, match="not a valid repository id"):
        shardmerge.merge(fsdp_ckpts / "fsdp2_w2_llama" / "actor", tmp_path / "out", quiet=True, upload_repo="not a/valid//name")
    assert not (tmp_path / "out").exists()
