"""Regenerate the YAML files from MergeConfig: ``python -m shardmerge.conf [FOLDER]`` (default: this package)."""

import sys
from pathlib import Path

from shardmerge.config import write_conf

write_conf(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent))
