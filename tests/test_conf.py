"""The YAML files shipped in shardmerge.conf agree with MergeConfig and instantiate the hooks."""

from __future__ import annotations

import dataclasses
import importlib.resources

from omegaconf import OmegaConf

from shardmerge.config import CONF_FILES, MergeConfig


def test_shipped_yaml_matches_mergeconfig():
    pkg = importlib.resources.files("shardmerge.conf")
    for name, make in CONF_FILES.items():
        assert (pkg / name).read_text() == make(), f"{name} is stale: run python -m shardmerge.conf"
    node = OmegaConf.to_container(OmegaConf.load(str(pkg / "shardmerge.yaml")))
    assert MergeConfig.from_mapping(node) == MergeConfig()
    assert set(node) == {f.name for f in dataclasses.fields(MergeConfig)}


def test_hydra_instantiates_merge_on_save():
    from hydra.utils import instantiate

    from shardmerge.hooks.lightning import MergeOnSave

    pkg = importlib.resources.files("shardmerge.conf")
    cfg = OmegaConf.load(str(pkg / "lightning.yaml"))
    cfg.dtype = "float32"
    cfg.keep_last = 3
    cb = instantiate(cfg)
    assert isinstance(cb, MergeOnSave)
    assert cb.config == MergeConfig(dtype="float32", keep_last=3)


def test_verl_yaml_node():
    pkg = importlib.resources.files("shardmerge.conf")
    cfg = OmegaConf.load(str(pkg / "verl.yaml"))
    assert cfg.merge_on_save is False
    assert MergeConfig.from_mapping(OmegaConf.to_container(cfg.shardmerge)) == MergeConfig()
