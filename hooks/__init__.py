"""Trainer-side integrations of shardmerge (imported as ``shardmerge.hooks.*``)."""
