"""Upload a merged directory to the HuggingFace hub with ``huggingface_hub`` (one process, one commit)."""

from __future__ import annotations

import logging
from pathlib import Path

from .errors import UploadError

log = logging.getLogger("shardmerge")


def upload(folder: Path, repo_id: str, private: bool = False, api=None) -> str:
    """Create ``repo_id`` if needed (model repo, ``private`` as given) and upload ``folder`` in one commit.

    Returns:
        the commit URL.

    Raises:
        UploadError: network, authentication or repository errors, in one line; the local folder is kept.
    """
    from huggingface_hub import HfApi

    api = api or HfApi()
    try:
        api.create_repo(repo_id=repo_id, private=private, repo_type="model", exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message=f"Upload {folder.name} merged by shardmerge",
        )
    except Exception as e:  # huggingface_hub raises HTTP, auth and OS errors of many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UploadError(f"upload of {folder} to {repo_id} failed: {type(e).__name__}: {first}; the local output is kept") from None
    url = getattr(info, "commit_url", None) or str(info)
    log.info("uploaded %s to %s", folder, url)
    return url
