"""Names that a model directory records (an adapter's base, a referenced query encoder) resolve locally only.

A name read from a file the user was given is not a request to contact a model hub: it resolves to a local directory
or to a snapshot already in the local hub cache (looked up without any network call), and a miss fails at once with
one line naming the field and the file. The user opts into downloads with ``HF_HUB_OFFLINE=0`` set explicitly
(:func:`hub_opted_in`).
"""

from __future__ import annotations

import os

from huggingface_hub import snapshot_download

from rag.utils.errors import ConfigError

__all__ = ["hub_opted_in", "resolve_recorded_name"]

_FALSE = ("0", "false", "no", "off")


def hub_opted_in() -> bool:
    """True only when the environment sets ``HF_HUB_OFFLINE`` to 0 / false / no / off (unset means: local only)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _FALSE


def resolve_recorded_name(name: str, field: str, where: str | os.PathLike) -> str:
    """A local path for the model `name` that field `field` of file `where` records.

    An existing directory is returned as is; a hub id resolves to its snapshot in the local hub cache
    (``local_files_only``: no network call); with :func:`hub_opted_in` the name is returned unchanged for the
    loader to fetch. Callers map their own aliases (a demo LM name, a bundled encoder) before calling.

    Raises:
        ConfigError: `name` is not a string, or neither a local directory nor cached while the hub is not opted
            into; one line naming `field`, `where` and the two fixes.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: field {field} is {name!r}, not a model name or directory; restore the file or save "
                          "the model again")
    if os.path.isdir(name) or hub_opted_in():
        return name
    try:
        return snapshot_download(repo_id=name, local_files_only=True)
    except Exception:  # not a repo id, or not in the cache: the same to the user
        raise ConfigError(
            f"{where}: field {field} names {name!r}, which is neither a local directory nor in the local model cache; "
            "names inside a model directory resolve locally only: put the model at that path (or edit the field to "
            "where it is), or set HF_HUB_OFFLINE=0 to let it be downloaded") from None
