"""Reading YAML a user wrote (configs, an imported model's inference.yml) with the limits PyYAML lacks.

`yaml.safe_load` runs no code, but it happily reads: a 718-byte alias bomb (nine anchors, each a list of nine
aliases of the previous: 9^9 leaves) that anything walking the result expands past gigabytes; a 5000-deep
list that ends in RecursionError; a duplicate key that silently replaces the first block (a whole `train:`
section lost); bytes in the locale's encoding. Here each is one ConfigError line:
- the document's size *as expanded* (every alias counted with the subtree it names) is at most MAX_NODES,
  and nesting at most MAX_DEPTH;
- a key given twice in one mapping names both lines (a `<<:` merge may still override, as YAML means);
- the text is UTF-8 (a BOM is allowed), whatever the locale;
- the file is a regular file of at most MAX_BYTES (a FIFO or /dev/zero would never end).
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from pipeline.core.errors import ConfigError

MAX_BYTES = 4 << 20           # the largest shipped config is a few KB; a PaddleOCR inference.yml with an
                              # 18k-character dictionary is ~200 KB
MAX_NODES = 200_000           # expanded nodes: that inference.yml is ~20k
MAX_DEPTH = 100


class _Refused(Exception):
    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


class _Loader(yaml.SafeLoader):
    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise _Refused(f"nesting deeper than {MAX_DEPTH} levels at line {mark.line + 1}",
                           "flatten the structure; no config needs this depth")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, MappingNode):
            _no_duplicates(node)
        return super().construct_mapping(node, deep=deep)


def _no_duplicates(node: MappingNode) -> None:
    seen: dict[tuple, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = (key_node.tag, key_node.value)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise _Refused(f"key '{key_node.value}' appears twice in one mapping (lines {seen[key]} and {line}); "
                           "YAML would keep only the second", "merge the two blocks into one")
        seen[key] = line


def _expanded_size(root) -> int:
    """Nodes of the document with every alias expanded, computed once per distinct node (nothing is expanded);
    an alias inside its own anchor (a recursive document) counts as unbounded."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    while stack:                                  # iterative post-order: aliases make the graph deeper
        n, done = stack.pop()
        if done:
            total = 1 + sum(sizes[id(c)] for c in _children(n))
            sizes[id(n)] = min(total, MAX_NODES + 1)
        elif id(n) not in sizes:
            sizes[id(n)] = MAX_NODES + 1              # in progress: reaching it again is a cycle
            stack.append((n, True))
            stack.extend((c, False) for c in _children(n) if id(c) not in sizes)
    return sizes[id(root)]


def _children(n):
    if isinstance(n, SequenceNode):
        return list(n.value)
    if isinstance(n, MappingNode):
        return [x for pair in n.value for x in pair]
    return []


def loads(text: str, where: str):
    """YAML text -> its object, or ConfigError naming `where` (a file, or an override)."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        size = _expanded_size(root)
        if size > MAX_NODES:
            raise _Refused(f"it expands to more than {MAX_NODES} values through its aliases (*name) "
                           "(an alias bomb)", "write the values out, or use fewer nested aliases")
        return loader.construct_document(root)
    except _Refused as exc:
        raise ConfigError(f"{where}: {exc}", hint=exc.hint) from None
    finally:
        loader.dispose()


def read(path: str | os.PathLike, what: str = "config file", max_bytes: int = MAX_BYTES):
    """A YAML file -> its object; not a regular file, too big or not UTF-8 -> one ConfigError line.
    yaml.YAMLError is left to the caller (which knows how to point at the line)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} not found: {p}", hint="pass an existing file")
    if not p.is_file():
        raise ConfigError(f"{what} {p} is not a regular file (a folder, FIFO or device)",
                          hint="pass a YAML file")
    size = p.stat().st_size
    if size > max_bytes:
        raise ConfigError(f"{what} {p} is {size} bytes, over the limit of {max_bytes}",
                          hint="a config is a few KB: is this the right file?")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} {p} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line})",
                          hint="save it as UTF-8") from None
    return loads(text, f"{what} {p}")
