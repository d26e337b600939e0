"""Merging real FSDP checkpoints: every tensor bit-exact, logits equal, HF files byte-equal, index consistent."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import ckpt_writers
import shardmerge
from conftest import leftovers

# verl-layout rank files of dense models (MoE and DCP jobs are covered in test_dcp_lightning_moe.py).
ALL_JOBS = [j for j, (fam, layout, _) in ckpt_writers.JOBS.items()
            if fam not in ("qwen3moe", "mixtral") and not layout.startswith("dcp") and layout not in ("accelerate", "lora")]


def load_dir(folder) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def expected_tensors(job_dir, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    ref = torch.load(job_dir / "reference.pt")
    family = ckpt_writers.JOBS[job_dir.name][0]
    if ckpt_writers.make_config(family).tie_word_embeddings:
        ref.pop("lm_head.weight")
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in ref.items()}


@pytest.mark.parametrize("job", ALL_JOBS)
def test_source_dtype_is_bit_exact(fsdp_ckpts, tmp_path, job):
    out = tmp_path / "hf"
    rep = shardmerge.merge(fsdp_ckpts / job / "actor", out, dtype="source", quiet=True)
    got = load_dir(out)
    want = expected_tensors(fsdp_ckpts / job, None)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k
    assert rep.tensors == len(want)
    assert rep.bytes == sum(v.numel() * v.element_size() for v in want.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("job", ["fsdp2_w4_qwen2", "hsdp_2x2_llama", "fsdp_tp_2x2_llama", "shard1_w4_qwen3"])
def test_default_bfloat16_equals_cast_of_trained_model(fsdp_ckpts, tmp_path, job):
    out = tmp_path / "hf"
    rep = shardmerge.merge(fsdp_ckpts / job / "actor", out, quiet=True)
    got = load_dir(out)
    want = expected_tensors(fsdp_ckpts / job, torch.bfloat16)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16
        assert torch.equal(got[k], v), k
    assert rep.dtype == "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert any("narrowing float32 -> bfloat16" in n for n in rep.notes)


@pytest.mark.parametrize("job,dtype", [("fsdp2_w2_llama", torch.bfloat16), ("fsdp2_w4_qwen2", torch.float32), ("fsdp2_w2_qwen3", torch.bfloat16)])
def test_from_pretrained_logits_equal_unsharded_model(fsdp_ckpts, tmp_path, job, dtype):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    shardmerge.merge(fsdp_ckpts / job / "actor", out, dtype=str(dtype).replace("torch.", ""), quiet=True)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()
    family = ckpt_writers.JOBS[job][0]
    # The unsharded trained model, built the way from_pretrained builds it (buffers such as rotary inv_freq stay
    # in float32), holding the trained weights in the written dtype.
    original = AutoModelForCausalLM.from_config(ckpt_writers.make_config(family), dtype=dtype).eval()
    ref = torch.load(fsdp_ckpts / job / "reference.pt")
    original.load_state_dict({k: v.to(dtype) for k, v in ref.items()})
    ids = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 11]])
    with torch.no_grad():
        a = merged(input_ids=ids).logits
        b = original(input_ids=ids).logits
    assert a.dtype == dtype
    assert torch.equal(a, b)
    # The merged model is the trained one, not a fresh initialisation.
    fresh = AutoModelForCausalLM.from_config(ckpt_writers.make_config(family), dtype=dtype).eval()
    with torch.no_grad():
        assert not torch.equal(fresh(input_ids=ids).logits, a)


def test_hf_files_are_byte_equal_and_manifest_written(fsdp_ckpts, tmp_path):
    src = fsdp_ckpts / "fsdp2_w2_llama" / "actor"
    out = tmp_path / "hf"
    rep = shardmerge.merge(src, out, quiet=True)
    hf = src / "huggingface"
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    assert set(rep.copied) >= {"config.json", "generation_config.json", "tokenizer.json"}
    cfg_in, cfg_out = json.loads((hf / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {k: v for k, v in cfg_out.items() if k != "dtype"} == {k: v for k, v in cfg_in.items() if k != "dtype"}
    m = json.loads((out / "shardmerge.json").read_text())
    assert m["schema_version"] == 1 and m["format"] == "fsdp" and m["world_size"] == 2
    assert m["source"] == str(src) and m["dtype"] == "bfloat16" and m["tensors"] == rep.tensors
    assert m["bytes"] == rep.bytes and m["files"] == ["model.safetensors"]
    assert not (out / ".shardmerge-owner").exists()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("hello world")["input_ids"] == AutoTokenizer.from_pretrained(str(hf))("hello world")["input_ids"]


def test_sharded_output_index_is_consistent(fsdp_ckpts, tmp_path):
    out = tmp_path / "hf"
    rep = shardmerge.merge(fsdp_ckpts / "fsdp2_w4_qwen2" / "actor", out, dtype="source", max_shard_size="20KB", quiet=True)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(idx["weight_map"].values())) == files
    total = 0
    for f in files:
        with safe_open(str(out / f), "pt") as h:
            keys = list(h.keys())
            assert all(idx["weight_map"][k] == f for k in keys)
            for k in keys:
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
            assert h.metadata() == {"format": "pt"}
        # Each file stays under the limit unless it holds a single larger tensor.
        data = (out / f).stat().st_size
        assert data <= 20_000 + 4096 or len(keys) == 1
    assert idx["metadata"]["total_size"] == total == rep.bytes
    assert idx["metadata"]["total_parameters"] == sum(math.prod(v.shape) for v in load_dir(out).values())
    assert set(rep.files) == set(files)


def test_small_blocks_stream_pieces_exactly(fsdp_ckpts, tmp_path):
    """A tiny memory budget forces many row blocks per tensor, each crossing piece boundaries."""
    for job in ("shard1_w4_qwen3", "fsdp_tp_2x2_llama", "fsdp2_w4_qwen2"):
        out = tmp_path / job
        shardmerge.merge(fsdp_ckpts / job / "actor", out, dtype="source", memory_budget="16KiB", workers=2, quiet=True)
        got, want = load_dir(out), expected_tensors(fsdp_ckpts / job, None)
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_inspect_reads_metadata_only(fsdp_ckpts, tmp_path, monkeypatch):
    from shardmerge.formats import base

    def no_data(*a, **k):
        raise AssertionError("inspect read tensor data")

    src = fsdp_ckpts / "fsdp_tp_2x2_llama" / "actor"
    monkeypatch.setattr(base.StorageSlice, "read_into", no_data)
    rep = shardmerge.inspect(src)
    assert rep.format == "fsdp" and rep.world_size == 4 and rep.mesh == "(dp=2, tp=2)"
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in rep.placements
    assert rep.tensors == 21 and rep.files == ["model.safetensors"]
    assert rep.predicted_peak_bytes > 0 and rep.target.endswith("actor_hf")
    assert not (src.parent / "actor_hf").exists()


def test_hsdp_replica_mismatch_is_detected(ckpt_copy, tmp_path):
    """Replicas are compared while reading: change one replica's bytes and the merge fails cleanly."""
    job = ckpt_copy("hsdp_2x2_llama")
    actor = job / "actor"
    # Rank 2 holds (ddp=1, fsdp=0): a replica of rank 0. Flip bytes of one of its tensor records.
    import struct
    import zipfile

    path = actor / "model_world_size_4_rank_2.pt"
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    # Data start from the *local* header (its extra field pads records to 64 bytes).
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    raw[start : start + 8] = bytes(255 - b for b in raw[start : start + 8])
    path.write_bytes(bytes(raw))
    with pytest.raises(shardmerge.SourceError, match="replicas differ"):
        shardmerge.merge(actor, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    # Without the check, the first copy is kept and the merge succeeds.
    shardmerge.merge(actor, tmp_path / "out", quiet=True, check_replicas=False)


def test_custom_code_copied_only_with_trust_remote_code(ckpt_copy, tmp_path):
    actor = ckpt_copy("fsdp2_w2_llama") / "actor"
    (actor / "huggingface" / "modeling_custom.py").write_text("# custom model code\n")
    shardmerge.merge(actor, tmp_path / "plain", quiet=True)
    assert not (tmp_path / "plain" / "modeling_custom.py").exists()
    rep = shardmerge.merge(actor, tmp_path / "trusted", quiet=True, trust_remote_code=True)
    assert (tmp_path / "trusted" / "modeling_custom.py").read_text() == "# custom model code\n"
    assert "modeling_custom.py" in rep.copied
