"""YAML a user hands LipStream (a broadcast script, from the command line or uploaded to a server), read with
bounds, so a small hostile file cannot take the machine's memory or time.

PyYAML's `safe_load` builds no objects it should not, but it follows aliases: a 500-byte document of nested
anchors stands for 10^9 items, which anything that walks it (printing, `str()`, a check) expands. Here the
document is composed into its node graph first (linear in the file's size: an alias is a reference to a node
already read), then checked before any Python object is built:

- the file's size (MAX_YAML_BYTES);
- the document's size with every alias expanded (MAX_YAML_NODES), counted once per node, so the count
  itself is linear; a node that contains itself is refused;
- no mapping repeats a key (YAML says keys are unique; PyYAML keeps the last one silently);
- no scalar is longer than MAX_YAML_SCALAR characters.

Every problem is one `InputError` line naming the file (and the line, where there is one).
"""

from __future__ import annotations

from pathlib import Path

from lipstream.errors import InputError

MAX_YAML_BYTES = 1 << 20  # 1 MiB: a long show's script is a few kilobytes
MAX_YAML_NODES = 100_000  # values, lists and mappings, every alias expanded
MAX_YAML_SCALAR = 65_536  # characters in one value: a text scene's words fit many times over

MERGE_TAG = "tag:yaml.org,2002:merge"


def load_yaml_file(path: str | Path) -> object:
    """The YAML document in `path` as Python objects (None for an empty file), within the bounds above."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise InputError(path, f"cannot read it ({e.strerror})") from None
    if size > MAX_YAML_BYTES:
        raise InputError(path, f"{size} bytes; a script of at most {MAX_YAML_BYTES} bytes (1 MiB) is allowed")
    try:
        text = path.read_bytes()[:MAX_YAML_BYTES + 1].decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(path, "not valid YAML (it is not UTF-8 text)") from None
    except OSError as e:
        raise InputError(path, f"cannot read it ({e.strerror})") from None
    return load_yaml_text(path, text)


def load_yaml_text(path: Path, text: str) -> object:
    """`text` (read from `path`, which the errors name) as Python objects, within the bounds above."""
    import yaml

    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise InputError(path, f"a script of at most {MAX_YAML_BYTES} bytes (1 MiB) is allowed")
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            raise InputError(path, f"not valid YAML ({_first_line(e)})") from None
        except RecursionError:
            raise InputError(path, "not valid YAML (nested too deeply)") from None
        if node is None:
            return None
        check_nodes(path, node)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as e:
            raise InputError(path, f"not valid YAML ({_first_line(e)})") from None
        except RecursionError:
            raise InputError(path, "not valid YAML (nested too deeply)") from None
    finally:
        loader.dispose()


def check_nodes(path: Path, root) -> None:
    """The bounds on a composed document (see the module's docstring), walked without recursion: the
    expanded size of each node is counted once and remembered, so shared (aliased) nodes cost nothing more."""
    import yaml

    size: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
    open_nodes: set[int] = set()  # on the current path: met again, the node contains itself
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            total = 1 + sum(size[id(c)] for c in _children(node))
            if total > MAX_YAML_NODES:
                raise InputError(path, f"line {node.start_mark.line + 1}: the document stands for more than "
                                       f"{MAX_YAML_NODES} values once its aliases (*name) are expanded; "
                                       "a script that size is not allowed")
            size[key] = total
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise InputError(path, f"line {node.start_mark.line + 1}: an alias refers to a value that contains it")
        if isinstance(node, yaml.ScalarNode):
            if len(node.value) > MAX_YAML_SCALAR:
                raise InputError(path, f"line {node.start_mark.line + 1}: a value of {len(node.value)} characters; "
                                       f"at most {MAX_YAML_SCALAR} are allowed")
            size[key] = 1
            continue
        if isinstance(node, yaml.MappingNode):
            _check_unique_keys(path, node)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)


def _children(node) -> list:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_unique_keys(path: Path, node) -> None:
    import yaml

    seen: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:
            continue  # a merge (<<) may repeat keys: the mapping's own win, as YAML says
        line = key.start_mark.line + 1
        first = seen.get((key.tag, key.value))
        if first is not None:
            raise InputError(path, f"line {line}: key {key.value[:80]!r} appears twice in one mapping "
                                   f"(first on line {first}); each key is allowed once")
        seen[(key.tag, key.value)] = line


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
