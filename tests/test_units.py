"""Small pieces with real values: sizes, prefixes, the restricted unpickler, the writer's plan."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch

from shardmerge.config import MergeConfig, parse_size
from shardmerge.convert.hf import choose_prefix, common_prefix
from shardmerge.errors import PickleRefusedError, ShardMergeError
from shardmerge.formats import safepickle


@pytest.mark.parametrize("text", ["5GB", "500MB", "20KB", "2GiB", "512MiB", "64KiB", "5Gb", "12345"])
def test_parse_size_matches_transformers(text):
    from transformers.utils.hub import convert_file_size_to_int

    expected = int(text) if text.isdigit() else convert_file_size_to_int(text)
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "5XB", "-3", "0", "GB", True])
def test_parse_size_rejects(bad):
    with pytest.raises(ShardMergeError):
        parse_size(bad)


def test_config_rejects_unknown_and_bad_values():
    with pytest.raises(ShardMergeError, match="unknown MergeConfig option"):
        MergeConfig.from_mapping({"dtpye": "float32"})
    with pytest.raises(ShardMergeError, match="dtype 'int8'"):
        MergeConfig(dtype="int8")
    assert MergeConfig().replace(dtype="float16").dtype == "float16"


def test_prefix_matching_uses_the_key_set():
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    names = ["model.model.embed_tokens.weight", "model.model.norm.weight", "model.lm_head.weight", "loss.weight"]
    assert choose_prefix(names, expected) == ("model.", 3)
    # a prefix equal to the HF base prefix is not stripped when the keys already match
    assert choose_prefix(sorted(expected), expected) == ("", 3)
    assert common_prefix(["module.a.b", "module.c"]) == "module."
    assert common_prefix(["model.a", "lm_head.weight"]) == ""


def test_stand_ins_for_harmless_foreign_objects():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"lr": 0.1, "model": {"hidden": 32}})
    data = pickle.dumps({"hparams": cfg, "w": 3})
    obj = safepickle.loads(data, "x.ckpt")
    assert obj["w"] == 3 and type(obj["hparams"]).__name__ == "DictConfig"
    assert isinstance(obj["hparams"], safepickle.Inert)


def test_refusal_names_global_and_file():
    data = pickle.dumps(io.StringIO("x"))
    with pytest.raises(PickleRefusedError, match=r"'_io.StringIO' in /tmp/f.pt"):
        safepickle.loads(data, "/tmp/f.pt")
    assert isinstance(safepickle.loads(data, "/tmp/f.pt", trust=True), io.StringIO)


def test_writer_plan_offsets_and_header():
    from shardmerge.formats.base import InMemory
    from shardmerge.writer import OutTensor, plan_files

    ts = [OutTensor("a", InMemory(torch.zeros(3, 5, dtype=torch.int64)), torch.int64),
          OutTensor("b", InMemory(torch.zeros(7)), torch.bfloat16),
          OutTensor("c", InMemory(torch.zeros(2, 2)), torch.float32)]
    [f] = plan_files(ts, 10**9)
    assert f.name == "model.safetensors"
    header = json.loads(f.header)
    assert len(f.header) % 8 == 0
    assert header["a"] == {"dtype": "I64", "shape": [3, 5], "data_offsets": [0, 120]}
    # widest items first: float32 before bfloat16, so every tensor starts aligned to its item size
    assert header["c"]["data_offsets"] == [120, 136] and header["b"]["data_offsets"] == [136, 150]
    assert f.size == 8 + len(f.header) + 150
