"""The package's shape: no import cycles (function-local imports included), no component importing a
recipe, every family in every registry, and no family told apart by its name outside the registries."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

from eyas.model.family_facts import FAMILIES, PART_FLOORS, family_part

PACKAGE = Path(__file__).resolve().parent.parent / "eyas"


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The eyas modules `module` imports anywhere in its file (top level or inside functions)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in candidates:
            while name and name not in known:  # `from eyas.x import f` names the module eyas.x
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def part_imports(path: Path) -> set[str]:
    """The modules a file imports through `family_part(name, "part")` calls: every family's declared module
    for that part (eyas.model.family_facts), so a family part that imports its reader back is a cycle too."""
    parts = {node.args[1].value for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "family_part"
             and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)}
    return {f.parts[p].partition(":")[0] for f in FAMILIES.values() for p in parts if p in f.parts}


def import_graph(root: Path = PACKAGE) -> nx.DiGraph:
    known = module_names(root)
    graph = nx.DiGraph()
    for module, path in known.items():
        graph.add_node(module)
        found = imported(module, path, known) | (part_imports(path) if root == PACKAGE else set())
        graph.add_edges_from((module, other) for other in found if other != module)
    return graph


def problems(graph: nx.DiGraph) -> list[str]:
    found = [" -> ".join([*cycle, cycle[0]]) for cycle in nx.simple_cycles(graph)]
    top = ("eyas.recipes", "eyas.cli", "eyas.__main__")
    found += [f"{a} imports the recipe {b}" for a, b in graph.edges
              if b.startswith("eyas.recipes") and not a.startswith(top)]
    return found


def test_no_import_cycles_and_no_component_imports_a_recipe():
    assert problems(import_graph()) == []


def test_the_walk_finds_function_local_cycles_and_upward_imports(tmp_path):
    """The check fails when it should: a cycle closed by an import inside a function, and a component
    reaching up to a recipe."""
    pkg = tmp_path / "eyas"
    for folder in ("model", "recipes"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text("from eyas.model.b import g\n")
    (pkg / "model" / "b.py").write_text("def g():\n    from eyas.model import a\n    from eyas.recipes.run import x\n")
    (pkg / "recipes" / "run.py").write_text("x = 1\n")
    found = problems(import_graph(pkg))
    assert any("eyas.model.a" in p and "eyas.model.b" in p and "->" in p for p in found)
    assert "eyas.model.b imports the recipe eyas.recipes.run" in found


def test_every_family_declares_each_part_on_its_floor():
    """Each part exists where the family says, on the floor that reads it (never above it)."""
    for name, fam in FAMILIES.items():
        assert {"model", "objective", "proposer", "writer"} <= set(fam.parts) <= set(PART_FLOORS), name
        for part, where in fam.parts.items():
            assert where.startswith(PART_FLOORS[part]), (name, part, where)
            assert family_part(name, part) is not None


def test_no_family_told_apart_by_name_outside_the_registries():
    """`cfg.family == "dflash"` and the like belong to the family's facts (eyas.model.family_facts).
    speculators' own `speculators_model_type` values happen to share two names; those compare a foreign
    config's field, not a family."""
    names = set(FAMILIES)
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            consts = [c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)]
            if any(isinstance(v, str) and v in names for v in consts) and "speculators_model_type" not in consts:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert offenders == []
