"""No module-level mutable state in src/ (DESIGN.md: "No global mutable state; tests must be able
to run several trainings in one process"): a cache, a registry or a resource lives in an object
with a lifetime (the S3 clients in a ``storage.shared_s3_clients`` scope or their store, the S3
block cache in the data sources that read through it), not in a module.

The scan (the AST of every module under src/podtrain, no import) finds:
* a module-level name bound to a mutable container (a dict/list/set literal or comprehension, or
  a call of ``dict``, ``list``, ``set``, ``OrderedDict``, ``defaultdict``, ``deque``, ``Counter``,
  a ``Weak*`` collection) that a function of the module changes (item assignment or deletion, an
  augmented assignment, or a mutating method: ``append``, ``update``, ``setdefault``...);
* a ``global`` statement;
* ``functools.lru_cache`` / ``functools.cache`` on a function (a process-wide memo);
* a module-level ``ContextVar`` (ambient state: allowed only where it is scoped by a ``with``).

``ALLOWED`` lists the few that are not caches of resources, each with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "podtrain"

CONTAINER_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter",
                   "WeakValueDictionary", "WeakKeyDictionary", "WeakSet", "ChainMap"}
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "add", "update", "setdefault",
            "pop", "popitem", "popleft", "remove", "discard", "clear", "sort", "reverse", "move_to_end",
            "__setitem__", "__delitem__"}
MEMO_DECORATORS = {"lru_cache", "cache"}

ALLOWED = {
    # A ContextVar set only by ``shared_s3_clients()``'s ``with`` block and reset when it ends: the
    # clients belong to that scope (which closes them), not to the module.
    ("storage/s3_client.py", "contextvar", "_scope"),
    # The same for one save's cancellation: set only by ``retry.cancellation()``'s ``with`` block on
    # the writer thread and reset when the save ends; the token belongs to the save, not the module.
    ("storage/retry.py", "contextvar", "_token"),
    # A ProcessPoolExecutor worker's own encoder, built once by the pool's initializer inside the
    # worker process (which the pool owns and ends); the main process never reads or writes it.
    ("data/prepare/encode.py", "global", "_worker_encoder"),
    # The DTensor class, imported once on first use (a save asks is_dtensor of every tensor): a
    # class, not a resource, and it cannot change within a process.
    ("ckpt/statedict.py", "global", "_DTENSOR"),
    # Memoised facts, not resources: whether this torch's fused optimizer class honours found_inf
    # on a device (a bool, probed once: it cannot change within a process) ...
    ("train/skip.py", "memo", "_honours_found_inf"),
    # ... and the schemas parsed from files shipped inside the package (read-only, never mutated).
    ("launch/schemas/__init__.py", "memo", "crd_schema"),
    ("launch/schemas/__init__.py", "memo", "hyperpod_model"),
}


def _call_name(node: ast.AST) -> str | None:
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_container(value: ast.AST | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _call_name(value) in CONTAINER_CALLS


def _module_bindings(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound at module level to a mutable container, names bound to a ContextVar)."""
    containers, contextvars = set(), set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(value, ast.Call) and _call_name(value) == "ContextVar":
            contextvars |= names
        elif _is_container(value) or isinstance(value, ast.Call):  # a call: an object that may hold state
            containers |= names
    return containers, contextvars


def _in_functions(node: ast.AST, inside: bool = False):
    """Every node within a function or lambda body, once each."""
    for child in ast.iter_child_nodes(node):
        within = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if within:
            yield child
        yield from _in_functions(child, within)


def _mutated(tree: ast.Module, names: set[str]) -> set[str]:
    """The ``names`` that some code of the module changes in place."""
    found = set()

    def base(node: ast.AST) -> str | None:
        while isinstance(node, (ast.Subscript, ast.Attribute)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    # Only code that runs after the import counts: a table filled by module-level statements
    # (optional dtypes looked up one by one) is a constant built in steps.
    for node in _in_functions(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):  # ``name[k] = v``, ``name.attr = v``, ``del name[k]``
            targets = [t for t in node.targets if isinstance(t, (ast.Subscript, ast.Attribute))]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target] if isinstance(node.target, (ast.Subscript, ast.Attribute, ast.Name)) else []
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        else:
            targets = []
        found |= {b for b in map(base, targets) if b in names}
    return found


def findings(path: Path, root: Path = SRC) -> set[tuple[str, str, str]]:
    """``(module path under root, kind, name)`` of each piece of module-level state."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root).as_posix()
    containers, contextvars = _module_bindings(tree)
    out = {(rel, "mutable", name) for name in _mutated(tree, containers)}
    out |= {(rel, "contextvar", name) for name in contextvars}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out |= {(rel, "global", name) for name in node.names}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
                if name in MEMO_DECORATORS:
                    out.add((rel, "memo", node.name))
    return out


def test_no_module_level_mutable_state_in_src():
    found = set().union(*(findings(p) for p in sorted(SRC.rglob("*.py"))))
    unexpected = sorted(found - ALLOWED)
    assert not unexpected, ("module-level mutable state (give it an owner with a lifetime, or add it "
                            f"to ALLOWED with why): {unexpected}")
    stale = sorted(ALLOWED - found)
    assert not stale, f"ALLOWED lists state that no longer exists: {stale}"


def test_the_scan_finds_each_kind(tmp_path):
    """The scan itself: each kind of module-level state is found, constants and locals are not."""
    code = '''
import functools
from contextvars import ContextVar
from collections import OrderedDict

CONSTANT = {"a": 1}            # never changed: a constant
TABLE = {}
for _name in ("x", "y"):
    TABLE[_name] = len(_name)  # filled at import: a constant too
NAMES = ("x", "y")
_cache: dict = {}
_seen = set()
_order = OrderedDict()
_scope = ContextVar("scope", default=None)
_registry = object()
_count = 0


def remember(key, value):
    _cache[key] = value
    _seen.add(key)
    _order.move_to_end(key)
    local = {}
    local["k"] = 1
    _registry.current = key


def bump():
    global _count
    _count += 1


@functools.lru_cache(maxsize=None)
def probe(x):
    return x
'''
    path = tmp_path / "sample.py"
    path.write_text(code)
    got = findings(path, tmp_path)
    assert got == {("sample.py", "mutable", "_cache"), ("sample.py", "mutable", "_seen"),
                   ("sample.py", "mutable", "_order"), ("sample.py", "contextvar", "_scope"),
                   ("sample.py", "global", "_count"), ("sample.py", "memo", "probe"),
                   ("sample.py", "mutable", "_registry")}, got
