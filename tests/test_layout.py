"""The package's layout rules, read from its source: what each part may reach.

- Executors are handed values (placement/topology.py's `Topology`, callables): no module
  but strategy.py reads a private attribute of the strategy's extended object.
- No circle of imports between the package's subpackages, nor among benchmarks/'s
  modules: every import counts, those made inside a function too.
- Placement has one owner: only placement/ asks the policy to decide or move a variable.
- TensorFlow's private modules are imported in one module only (tensorflow_private.py),
  which names what the package reads from each and why.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hybrid_strategy")


def sources(folder):
    """{path relative to the repository: parsed module} of every .py file under `folder`."""
    found = {}
    for directory, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    found[os.path.relpath(path, ROOT)] = ast.parse(f.read(), path)
    return found


def imported(tree, prefix):
    """Modules under `prefix` that `tree` imports (a `from X import name` counts as X.name)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
    return {name for name in names if name == prefix or name.startswith(prefix + ".")}


def circles(graph):
    """Every strongly connected set of more than one node of `graph` ({node: {nodes}})."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.add(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def subpackage(module):
    """'hybrid_strategy.tables.table' -> 'tables'; top-level modules stand for themselves."""
    parts = module.split(".")
    if len(parts) > 2 or os.path.isdir(os.path.join(PACKAGE, parts[1])):
        return parts[1]
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_module_but_the_strategy_reads_its_private_attributes():
    readers = []
    for path, tree in sources(PACKAGE).items():
        if path == os.path.join("hybrid_strategy", "strategy.py"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and isinstance(node.value, (ast.Attribute, ast.Name))
                    and getattr(node.value, "attr", getattr(node.value, "id", None))
                    == "extended"):
                readers.append(f"{path}:{node.lineno} extended.{node.attr}")
    assert not readers, readers


def test_no_circle_of_imports_between_subpackages():
    graph = {}
    for path, tree in sources(PACKAGE).items():
        source = subpackage(path[:-3].replace(os.sep, "."))
        for module in imported(tree, "hybrid_strategy"):
            if module != "hybrid_strategy":
                target = subpackage(module)
                if target != source:
                    graph.setdefault(source, set()).add(target)
    assert circles(graph) == [], circles(graph)


def test_no_circle_of_imports_among_the_benchmarks():
    graph = {}
    for path, tree in sources(os.path.join(ROOT, "benchmarks")).items():
        source = path[:-3].replace(os.sep, ".")
        graph[source] = {".".join(m.split(".")[:2]) for m in imported(tree, "benchmarks")
                         if m.count(".") >= 1} - {source}
    assert circles(graph) == [], circles(graph)


@pytest.mark.parametrize("method", ["decide", "move_to_ps", "move_to_mirrored"])
def test_only_placement_decides_and_moves_variables(method):
    callers = sorted(
        f"{path}:{node.lineno}" for path, tree in sources(PACKAGE).items()
        if not path.startswith(os.path.join("hybrid_strategy", "placement"))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == method and "policy" in ast.unparse(node.func.value))
    assert not callers, callers


def fenced_names(tree):
    """{local name: name in tensorflow_private} of what `tree` imports from the fence."""
    return {alias.asname or alias.name: alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and node.module == "hybrid_strategy.tensorflow_private"
            for alias in node.names}


def test_tensorflow_private_modules_are_imported_through_the_fence_only():
    fence = os.path.join("hybrid_strategy", "tensorflow_private.py")
    importers = sorted(
        f"{path}:{node.lineno}" for path, tree in sources(PACKAGE).items() if path != fence
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(name.startswith("tensorflow.python") for name in
                ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names])))
    assert not importers, importers


def test_every_tensorflow_private_name_read_is_declared_and_exists():
    from hybrid_strategy import tensorflow_private  # pylint: disable=import-outside-toplevel
    undeclared, read = [], set()
    for path, tree in sources(PACKAGE).items():
        fenced = fenced_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in fenced):
                module = fenced[node.value.id]
                read.add((module, node.attr))
                if node.attr not in tensorflow_private.REACHES[module][0]:
                    undeclared.append(f"{path}:{node.lineno} {module}.{node.attr}")
    assert not undeclared, undeclared
    unread = [f"{module}.{name}" for module, (names, _) in
              tensorflow_private.REACHES.items() for name in names
              if (module, name) not in read]
    assert not unread, f"declared in REACHES but read nowhere: {unread}"
    missing = [f"{module}.{name}" for module, (names, _) in
               tensorflow_private.REACHES.items() for name in names
               if not hasattr(getattr(tensorflow_private, module), name)]
    assert not missing, missing
