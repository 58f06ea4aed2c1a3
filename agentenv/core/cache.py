"""agentenv's on-disk cache: things built or unpacked once per machine (tiny models, tokenizers, shipped games).

Contract: :func:`cache_dir` is ``$AGENTENV_CACHE`` or ``~/.cache/agentenv``. :func:`atomic_dir` creates a directory
by building it under a temporary name and renaming it into place, so a reader never sees a half-built directory and
concurrent builders (parallel tests, Ray actors) end with one identical copy. Names must carry whatever the content
depends on (a config fingerprint, an archive hash): an existing directory is returned as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTENV_CACHE", Path.home() / ".cache" / "agentenv"))


def atomic_dir(target: Path, build) -> Path:
    """Create ``target`` by calling ``build(tmp_dir)`` then renaming; tolerate a concurrent winner."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first; theirs is identical
            if not target.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
