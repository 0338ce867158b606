"""Reading untrusted files: the package's one JSON reader, bounded in size and nesting, and the context that turns a
model file a parser cannot read into an :class:`~rag.utils.errors.IntegrityError` naming that file.

Every JSON file `rag` opens (manifests, ``rag_config.json``, a model's ``config.json``, corpora and QA data) goes
through :func:`read_json` or, for one line or record, :func:`parse_json`. Both refuse what Python's parser handles
badly: a file larger than its bound is never read into memory, and nesting deeper than :data:`MAX_JSON_DEPTH` (which
the C parser reports as a ``RecursionError`` from about 1,000 levels) is an error naming the file. Model directories
are also read by transformers, tokenizers and datasets, which parse their JSON files themselves:
:func:`check_json_files` runs each of them through :func:`read_json` first.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import stat
from pathlib import Path
from typing import IO, Any, Iterator, Optional

from rag.utils.errors import IntegrityError, RagError

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "parse_json", "read_json", "check_json_files", "readable_model_files",
           "regular_file", "bounded_lines"]

MAX_JSON_BYTES = 256 << 20
"""Largest JSON file read whole (256 MiB: a large tokenizer.json is ~10 MB, a knowledge-base manifest ~10 KB)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays accepted (the files rag reads nest at most ~6 levels)."""
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")  # where a refused pickle is looked for


def regular_file(path: str | os.PathLike, what: str, *, error: type[RagError] = RagError) -> os.stat_result:
    """`path`'s stat when it is a regular file (after symbolic links), else `error` naming it: a device (``/dev/zero``),
    a pipe or a socket would be read without end, a directory is not a file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file; check the path ({what})") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror}); check the path ({what})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: is a directory, not a file ({what})")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a character device" if stat.S_ISCHR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
                else "a pipe (FIFO)" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise error(f"{path}: is {kind}, not a regular file; {what} must be a file (a device or pipe is never read, "
                    "as it may never end) — write its content to a file first")
    return st


def bounded_lines(f: IO[str], where: str, limit: int, *, error: type[RagError] = RagError,
                  fix: str = "check that the file is text with line breaks") -> Iterator[str]:
    """The lines of a text stream, each read with at most `limit` + 1 characters in memory; `error` naming
    ``where:line``, the limit and `fix` for a longer one (a file without line breaks is never read whole)."""
    for lineno in itertools.count(1):
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(("\n", "\r")):
            raise error(f"{where}:{lineno}: a line longer than {limit:,} characters; {fix}")
        yield line


def _too_deep(obj: Any, max_depth: int) -> bool:
    """True when `obj` (parsed JSON) nests objects/arrays deeper than `max_depth` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_json(text: str | bytes, where: str, *, fix: str, error: type[RagError] = RagError,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`text` parsed as JSON, or `error` whose message starts with `where` (a file, ``file:line``) and ends with `fix`:
    not UTF-8, not JSON (with the line and column), or nested deeper than `max_depth`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise error(f"{where}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}); {fix}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {fix}") from None
    except RecursionError:
        value = None
        deep = True
    else:
        deep = _too_deep(value, max_depth)
    if deep:
        raise error(f"{where}: JSON nested more than {max_depth} levels deep (no file rag reads nests so deep; the file is "
                    f"damaged or hostile); {fix}")
    return value


def read_json(path: str | os.PathLike, *, fix: str, error: type[RagError] = IntegrityError,
              max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of the file `path`, read only when it is a regular file of at most `max_bytes`; otherwise, or when
    it is not UTF-8 JSON nested at most `max_depth` levels, `error` naming the file, the limit and `fix`."""
    st = regular_file(path, "a JSON file", error=error)
    if st.st_size > max_bytes:
        raise error(f"{path}: {st.st_size:,} bytes, larger than the {max_bytes:,} bytes a JSON file of rag may hold; {fix}")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror}); {fix}") from None
    if len(data) > max_bytes:  # it grew after the stat
        raise error(f"{path}: larger than the {max_bytes:,} bytes a JSON file of rag may hold; {fix}")
    return parse_json(data, str(path), fix=fix, error=error, max_depth=max_depth)


def check_json_files(directory: str | os.PathLike, *, fix: str, error: type[RagError] = IntegrityError) -> None:
    """Read every ``*.json`` file directly in `directory` with :func:`read_json` (a no-op for anything but a directory):
    transformers, tokenizers and datasets parse them with no bound on size or nesting."""
    d = Path(directory)
    if not d.is_dir():
        return
    for f in sorted(d.glob("*.json")):
        read_json(f, fix=fix, error=error)


def _damaged_file(directory: Path) -> Optional[Path]:
    """The first file under `directory` whose header or JSON cannot be read (None when each reads): safetensors headers
    (``safe_open`` reads only the header) and JSON files. Only a parse failure marks a file: a read that fails for want
    of memory (after a failed allocation) blames none."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(directory.rglob("*")):
        if not f.is_file():
            continue
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt"):
                    pass
            elif f.suffix == ".json":
                read_json(f, fix="")
        except MemoryError:
            return None
        except (RagError, SafetensorError, OSError, ValueError, UnicodeDecodeError):
            return f
    return None


@contextlib.contextmanager
def readable_model_files(directory: str | os.PathLike, what: str, fix: str) -> Iterator[None]:
    """Turn a model file that a parser cannot read (garbage in ``model.safetensors``, a truncated ``config.json``, a
    settings file lacking a field) into an IntegrityError naming the file (else `directory`), `what` it belongs to and
    `fix`, instead of the parser's own exception (``SafetensorError: header too large``, ``KeyError: 'max_length'``);
    a pickle that torch's ``weights_only`` loader refuses is named as such (pickled code is never run)."""
    from safetensors import SafetensorError

    try:
        yield
    except RagError:
        raise
    except pickle.UnpicklingError as e:  # torch's weights_only loader met code or objects beyond plain tensors
        d = Path(directory)
        pickles = sorted(f for f in d.rglob("*") if f.suffix in _PICKLE_SUFFIXES and f.is_file()) if d.is_dir() else []
        where = pickles[0] if pickles else d
        raise IntegrityError(f"{where}: a pickle holding more than plain tensors ({what}); pickles are never loaded beyond "
                             "tensor data (no pickled code or object is run) — save the weights as safetensors "
                             "(save_pretrained) and remove the pickle") from e
    except (SafetensorError, OSError, ValueError, EOFError, RuntimeError, UnicodeDecodeError, KeyError, TypeError) as e:
        d = Path(directory)
        culprit = _damaged_file(d) if d.is_dir() else None
        where = culprit if culprit is not None else d
        reason = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise IntegrityError(f"{where}: {what} cannot be loaded ({reason}); {fix}") from e
