"""Hydra / OmegaConf YAML files for shardmerge options (package data of ``shardmerge.conf``)."""
