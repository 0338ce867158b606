"""Bounds on the YAML a user gives (``rag fit --config FILE``): aliases may not expand a config beyond a small budget.

YAML aliases (``*name``) repeat an anchored node wherever they appear, and a loader builds every repetition: nine
lines of nested anchors expand to 9^9 nodes (gigabytes). :func:`check_yaml_text` walks the parser's event stream,
which never expands an alias (time and memory linear in the text), and counts the nodes each alias would add;
:func:`check_cli_yaml` applies it to every YAML a command line names, before any loader reads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import yaml

from rag.utils.errors import ConfigError
from rag.utils.files import regular_file

__all__ = ["MAX_ALIAS_NODES", "MAX_YAML_BYTES", "MAX_YAML_DEPTH", "check_yaml_text", "check_yaml_file", "check_cli_yaml"]

MAX_ALIAS_NODES = 10_000
"""Most nodes the aliases of one YAML text may add when expanded (a shipped config has no alias and ~200 nodes)."""
MAX_YAML_BYTES = 16 << 20
"""Largest YAML config read (16 MiB; the shipped configs are 1-5 KB)."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and sequences accepted (the loaders recurse per level)."""
_SUFFIXES = (".yaml", ".yml")
_MAX_FILES = 64  # config files followed through the values of one command line


def check_yaml_text(text: str, where: str) -> None:
    """ConfigError naming `where` when the aliases in `text` would add more than :data:`MAX_ALIAS_NODES` nodes, or it
    nests deeper than :data:`MAX_YAML_DEPTH`.

    Text that does not parse as YAML is left to the loader, which reports it in its own words."""
    sizes: dict[str, int] = {}  # expanded node count of each anchor seen so far
    stack: list[list] = []  # open collections: [anchor, expanded node count]
    added = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([event.anchor, 1])
                if len(stack) > MAX_YAML_DEPTH:
                    raise ConfigError(f"{where}: nests more than {MAX_YAML_DEPTH} levels deep (line "
                                      f"{event.start_mark.line + 1}); "
                                      "a config nests a few levels")
                continue
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, n = stack.pop()
                if anchor is not None:
                    sizes[anchor] = n
            elif isinstance(event, yaml.ScalarEvent):
                n = 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                n = sizes.get(event.anchor, 1)
                added += n
                if added > MAX_ALIAS_NODES:
                    raise ConfigError(
                        f"{where}: its YAML aliases (*{event.anchor} and others) expand to more than {MAX_ALIAS_NODES:,} "
                        "nodes; write the values out (a config needs no alias repeated at that scale)")
            else:
                continue
            if stack:
                stack[-1][1] += n
    except yaml.YAMLError:
        return


def check_yaml_file(path: str | os.PathLike, what: str = "a YAML config") -> None:
    """:func:`check_yaml_text` for a file (a regular file of at most :data:`MAX_YAML_BYTES`), and for the YAML files
    its values name (jsonargparse loads a value that is such a path), each refused naming it."""
    _check_file(Path(path), what, set())


def _check_file(path: Path, what: str, seen: set) -> None:
    seen.add(path.resolve())
    st = regular_file(path, what, error=ConfigError)
    if st.st_size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {st.st_size:,} bytes, over the {MAX_YAML_BYTES >> 20} MiB a YAML config may have; "
                          f"check the path ({what})")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read(MAX_YAML_BYTES + 1)
    check_yaml_text(text, str(path))
    try:
        data = yaml.safe_load(text)  # bounded now: its aliases passed the check
    except yaml.YAMLError:
        return
    strings, stack = [], [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and node.endswith(_SUFFIXES):
            strings.append(node)
    for value in strings:
        for p in (Path(value), path.parent / value):
            if p.is_file() and p.resolve() not in seen and len(seen) < _MAX_FILES:
                _check_file(p, f"named in {path}", seen)


def check_cli_yaml(argv: Sequence[str]) -> None:
    """Check every YAML a LightningCLI command line can make its parser read: each ``--config`` file, each value that
    names a ``.yaml``/``.yml`` file (and the YAML files those name), and each value itself (jsonargparse parses option
    values as YAML). ConfigError naming the file (or option value) at fault."""
    values = []
    args = list(argv)
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if a.startswith("--") and eq:
            values.append((name, value))
        elif i and args[i - 1].startswith("--"):
            values.append((args[i - 1], a))
    for option, value in values:
        if option == "--config" or (value.endswith(_SUFFIXES) and os.path.exists(value)):
            check_yaml_file(value, f"{option} FILE")
        elif "*" in value:
            check_yaml_text(value, f"the value of {option}")
