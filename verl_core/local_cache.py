"""The private per-user cache folder for run assets (``engine/assets.py``) and finished warm starts
(``warmstart.py``): where it is and the check that it is ours alone. A convenience, never a source
of truth: what is read from it is checked against recorded hashes by its users.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile

from verl_core.errors import PermanentError


class AssetCacheError(PermanentError):
    """The local asset cache folder is not private to this user."""


def cache_root() -> str:
    """``$VERL_ASSET_CACHE``, else ``$XDG_CACHE_HOME/verl-flyte/assets`` (``~/.cache/…``), else a
    per-user folder in the system temp folder. Created with mode 0700."""
    root = os.environ.get("VERL_ASSET_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "verl-flyte", "assets")
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError:  # no writable home (some containers): a per-user temp folder
            root = os.path.join(tempfile.gettempdir(), f"verl-assets-{os.getuid()}")
    return _private_dir(root)


def _private_dir(path: str) -> str:
    """Create ``path`` (0700) or check an existing one: owned by us and not accessible to others.
    A folder another user can write into could swap the weights a run trains on."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AssetCacheError(f"asset cache {path} is not a plain folder; point VERL_ASSET_CACHE "
                              "at a folder of your own")
    if st.st_uid != os.getuid():
        raise AssetCacheError(f"asset cache {path} belongs to uid {st.st_uid}, not to you (uid "
                              f"{os.getuid()}); point VERL_ASSET_CACHE at a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours: make it private rather than refuse
    return path


def file_sha256(path: str) -> str:
    """sha256 of the file at ``path``, read in 1 MiB chunks (a model's weights need not fit twice
    in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def files_under(folder: str) -> list[str]:
    """Every file below ``folder``, as sorted paths relative to it."""
    out = []
    for dirpath, _, files in os.walk(folder):
        out += [os.path.relpath(os.path.join(dirpath, f), folder) for f in files]
    return sorted(out)
