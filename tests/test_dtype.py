"""Dtype policy: bfloat16 by default, source kept bit-exact, ints never cast, float16 overflow refused,
non-finite values passed through and counted."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import ckpt_writers
import shardmerge
from conftest import leftovers


def test_float16_overflow_is_an_error(tmp_path):
    src = tmp_path / "ckpt"
    sd = dict(ckpt_writers.write_single(src, "llama"))
    sd["model.norm.weight"] = sd["model.norm.weight"].clone()
    sd["model.norm.weight"][3] = 1.0e6
    torch.save(sd, src / "model_world_size_1_rank_0.pt")
    with pytest.raises(shardmerge.DtypeError, match=r"model.norm.weight: 1 finite value.*1e\+06.*float16"):
        shardmerge.merge(src, tmp_path / "out", dtype="float16", quiet=True)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    # bfloat16 has the range for it
    shardmerge.merge(src, tmp_path / "out", quiet=True)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(got, sd["model.norm.weight"].to(torch.bfloat16)) and got[3].item() > 9.9e5


def test_nonfinite_values_pass_through_and_are_counted(tmp_path):
    src = tmp_path / "ckpt"
    sd = dict(ckpt_writers.write_single(src, "llama"))
    w = sd["model.layers.0.mlp.up_proj.weight"].clone()
    w[0, 0], w[1, 1], w[2, 2] = float("nan"), float("inf"), float("-inf")
    sd["model.layers.0.mlp.up_proj.weight"] = w
    torch.save(sd, src / "model_world_size_1_rank_0.pt")
    rep = shardmerge.merge(src, tmp_path / "out", dtype="float16", quiet=True)
    assert rep.nonfinite == {"model.layers.0.mlp.up_proj.weight": 3}
    got = load_file(str(tmp_path / "out" / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    assert torch.isnan(got[0, 0]) and got[1, 1].item() == float("inf") and got[2, 2].item() == float("-inf")
    assert torch.equal(got.isfinite(), w.isfinite())
    assert json.loads((tmp_path / "out" / "shardmerge.json").read_text())["nonfinite"] == rep.nonfinite


def test_integer_and_bool_tensors_never_cast(tmp_path):
    """A model whose state dict holds an int64 and a bool buffer (persistent) keeps their dtypes and values."""
    from transformers import LlamaForCausalLM

    cfg = ckpt_writers.make_config("llama")
    model = LlamaForCausalLM(cfg)
    model.register_buffer("step_count", torch.tensor([7, 123456789012], dtype=torch.int64))
    model.model.register_buffer("mask", torch.tensor([True, False, True]))
    sd = model.state_dict()
    src = tmp_path / "ckpt"
    ckpt_writers.write_single(src, "llama", sd=sd)

    from shardmerge.convert.hf import convert_hf_named
    from shardmerge.engine import output_dtype

    assert output_dtype("bfloat16", torch.int64) == torch.int64
    assert output_dtype("float16", torch.bool) == torch.bool
    assert output_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert output_dtype("source", torch.float32) == torch.float32
    # The buffers are not part of LlamaForCausalLM's key set, so write them through the writer directly.
    from shardmerge.formats.base import InMemory
    from shardmerge.writer import CastStats, OutTensor, plan_files, write_files

    out = tmp_path / "w"
    out.mkdir()
    ts = [OutTensor(k, InMemory(v), output_dtype("bfloat16", v.dtype)) for k, v in sd.items()]
    write_files(plan_files(ts, 10**9), out, 2, 4096, CastStats())
    got = load_file(str(out / "model.safetensors"))
    assert got["step_count"].dtype == torch.int64 and got["step_count"].tolist() == [7, 123456789012]
    assert got["model.mask"].dtype == torch.bool and got["model.mask"].tolist() == [True, False, True]
    assert got["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lm_head.weight"], sd["lm_head.weight"].to(torch.bfloat16))
    assert convert_hf_named  # imported for the key-set path used above by merge()


def test_bfloat16_source_kept_exact_under_float32_request(tmp_path):
    """Widening is exact: a bfloat16 checkpoint written as float32 round-trips to the same bf16 values."""
    src = tmp_path / "ckpt"
    sd = {k: v.to(torch.bfloat16) for k, v in ckpt_writers.write_single(src, "llama").items()}
    torch.save(sd, src / "model_world_size_1_rank_0.pt")
    shardmerge.merge(src, tmp_path / "f32", dtype="float32", quiet=True)
    got = load_file(str(tmp_path / "f32" / "model.safetensors"))
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k].to(torch.bfloat16), v) for k, v in sd.items())
    rep = shardmerge.merge(src, tmp_path / "src", dtype="source", quiet=True)
    assert rep.dtype == "bfloat16"
    assert json.loads((tmp_path / "src" / "config.json").read_text())["dtype"] == "bfloat16"
