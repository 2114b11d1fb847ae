"""megatron/core's import graph: imports run one way (no cycle between its sub-packages and top-level modules, lazy
imports inside functions included) and nothing in it imports the framework above it (megatron.training,
megatron.tokenizer, megatron.legacy, megatron.model, megatron.inference) or reads global args.

The graph is built here from the source with ``ast`` (every ``import`` / ``from ... import`` anywhere in a file);
a "part" is the first component under megatron/core (``transformer``, ``utils``, ``parallel_state`` ...).
"""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORE = os.path.join(REPO, "megatron", "core")
UPWARD = ("megatron.training", "megatron.tokenizer", "megatron.legacy", "megatron.model", "megatron.inference")


def _imports(path, module):
    """Every module name an import statement of ``path`` (module ``module``) names, with its line."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def _part(module):
    bits = module.split(".")
    if bits[:2] != ["megatron", "core"] or len(bits) < 3:
        return None
    if os.path.isdir(os.path.join(CORE, bits[2])) or os.path.isfile(os.path.join(CORE, bits[2] + ".py")):
        return bits[2]
    return None


def _graph():
    edges, upward = {}, []
    for dirpath, _, files in os.walk(CORE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, REPO)
            module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
            src = _part(module)
            for target, line in _imports(path, module):
                if target.startswith(UPWARD):
                    upward.append(f"{rel}:{line} imports {target}")
                dst = _part(target)
                if src and dst and dst != src:
                    edges.setdefault(src, {}).setdefault(dst, f"{rel}:{line}")
    return edges, upward


def _cycles(edges):
    """Strongly connected components with more than one part (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_core_imports_run_one_way():
    edges, upward = _graph()
    assert edges, "no import found: the walk is broken"
    assert "transformer" in edges.get("models", {}), "models must see transformer (sanity check of the walk)"
    report = [f"{' <-> '.join(c)}: " + "; ".join(f"{a} -> {b} ({edges[a][b]})" for a in c for b in edges.get(a, {})
                                                  if b in c) for c in _cycles(edges)]
    assert not report, "import cycles inside megatron/core:\n" + "\n".join(report)
    assert not upward, "megatron/core imports the framework above it:\n" + "\n".join(upward)


def test_core_reads_no_global_args():
    offenders = []
    for dirpath, _, files in os.walk(CORE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                for i, line in enumerate(open(path, encoding="utf-8"), 1):
                    if "get_args()" in line and not line.lstrip().startswith("#"):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{i}")
    assert not offenders, "megatron/core reads global args: " + ", ".join(offenders)


def test_cycle_finder_finds_a_cycle():
    """The check above could only pass vacuously if the cycle finder were broken: it must see a planted one."""
    assert _cycles({"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}, "d": {"a": "w"}}) == [["a", "b", "c"]]
