"""The dependency rule of docs/explanation/architecture.md: a module imports only its own layer or the
layers below it, siblings of one layer stay apart, and no import cycle exists, counting
imports made inside functions too.  Read from the source (ast), nothing is imported."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first.  A module belongs to the first prefix that matches it.
LAYERS = [
    ("base", ["psrt.errors", "psrt.env", "psrt.faults", "psrt.trace"]),
    ("world", ["psrt.world"]),
    ("transport", ["psrt.transport"]),
    ("collectives", ["psrt.collectives", "psrt.watchdog"]),
    ("grid", ["psrt.grid"]),
    ("strategies", ["psrt.dp", "psrt.pp", "psrt.tp", "psrt.c10d", "psrt.ep"]),
    ("entry points", ["psrt.train", "psrt.launch"]),
    ("benchmarks", ["psrt.bench", "psrt.cluster", "psrt.info"]),
]
# Packages of one layer that must not import each other.
SIBLINGS = [("psrt.dp", "psrt.pp", "psrt.tp", "psrt.c10d", "psrt.ep"), ("psrt.train", "psrt.launch")]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in (ROOT / "psrt").rglob("*.py")}


def imports(name: str) -> set[str]:
    """Every psrt module `name` imports, anywhere in the file."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name and m != "psrt"}


def layer_of(name: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{name} is in no layer of docs/explanation/architecture.md: add it to LAYERS")


def test_every_module_has_a_layer():
    for name in MODULES:
        if name != "psrt":
            layer_of(name)


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m != "psrt"))
def test_no_module_imports_a_higher_layer(name):
    upward = [m for m in imports(name) if layer_of(m) > layer_of(name)]
    assert not upward, f"{name} ({LAYERS[layer_of(name)][0]}) imports {upward} from a higher layer"


def test_siblings_stay_apart():
    crossing = []
    for group in SIBLINGS:
        for name in MODULES:
            mine = next((p for p in group if name == p or name.startswith(p + ".")), None)
            if mine:
                crossing += [f"{name} -> {m}" for m in imports(name)
                             for other in group if other != mine and (m == other or m.startswith(other + "."))]
    assert not crossing, crossing


def test_no_import_cycle():
    graph = {name: imports(name) for name in MODULES}
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_at_most_ten_top_level_modules():
    top = sorted(p.name for p in (ROOT / "psrt").glob("*.py"))
    assert len(top) <= 10, top
