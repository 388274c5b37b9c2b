"""The package's import structure (ARCHITECTURE.md): no import circles, no wing importing a stage module, no
module importing another module's private names. Every import counts, also those inside functions: a lazy
import is still a dependency."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"prepare", "extract", "infer", "lengths", "train", "acceptance", "value"}


def imports(pkg_dir: Path) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, imported name or "")} for imports of the package's own modules."""
    pkg = pkg_dir.name
    mods = {".".join(p.relative_to(pkg_dir.parent).with_suffix("").parts): p for p in pkg_dir.rglob("*.py")}
    mods = {m.removesuffix(".__init__"): p for m, p in mods.items()}
    out: dict[str, set[tuple[str, str]]] = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {(a.name, "") for a in node.names if a.name.split(".")[0] == pkg}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == pkg:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add((sub, "") if sub in mods else (node.module, a.name))
        out[mod] = {(m, n) for m, n in deps if m in mods and m != mod}
    return out


def problems(pkg_dir: Path, stages: set[str]) -> list[str]:
    graph = imports(pkg_dir)
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep, name in sorted(deps):
            # the toy world's builder (the fixed benchmark, not edited for style) shares helpers inside itself
            if name.startswith("_") and not name.startswith("__") and not mod.startswith("eagle_lib.toy."):
                bad.append(f"private import: {mod} imports {dep}.{name}")
            parts = dep.split(".")
            if mod.count(".") >= 2 and len(parts) == 2 and parts[1] in stages:
                bad.append(f"wing imports a stage: {mod} -> {dep}")
    edges = {m: {d for d, _ in deps} for m, deps in graph.items()}
    seen_cycles = set()
    for start in edges:  # a circle = a path from a module back to itself
        stack = [(start, (start,))]
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    cyc = tuple(sorted(path))
                    if cyc not in seen_cycles:
                        seen_cycles.add(cyc)
                        bad.append("import circle: " + " -> ".join(path + (start,)))
                elif nxt not in path and len(path) < 12:
                    stack.append((nxt, path + (nxt,)))
    return bad


def test_eagle_lib_has_no_circle_no_upward_import_no_private_import():
    assert problems(ROOT / "eagle_lib", STAGES) == []


def test_the_check_sees_each_kind(tmp_path):
    pkg = tmp_path / "pk"
    (pkg / "wing").mkdir(parents=True)
    for f, text in {
        "__init__.py": "",
        "stage.py": "from pk.wing import a\n",
        "wing/__init__.py": "",
        "wing/a.py": "def f():\n    from pk.wing import b\n",  # lazy: still an edge
        "wing/b.py": "from pk.wing.a import f\nfrom pk.wing.c import _hidden\n",
        "wing/c.py": "_hidden = 1\n\ndef g():\n    import pk.stage\n",
    }.items():
        (pkg / f).write_text(text)
    got = problems(pkg, {"stage"})
    assert "private import: pk.wing.b imports pk.wing.c._hidden" in got
    assert "wing imports a stage: pk.wing.c -> pk.stage" in got
    assert any(g.startswith("import circle") and "pk.wing.a" in g and "pk.wing.b" in g for g in got)
    assert sum(g.startswith("import circle") for g in got) == 2  # a<->b, and stage -> a -> b -> c -> stage


def node(mod: str) -> str:
    """The package-level node of a module: its sub-package (eagle_lib.drafter) or, for a top-level module
    (eagle_lib/models.py), the module itself."""
    return ".".join(mod.split(".")[:2])


def package_circles(pkg_dir: Path) -> list[str]:
    """Import circles between the package's sub-packages and top-level modules, each named with one module-level
    import per arrow: eagle_lib.drafter.* importing eagle_lib.hidden_states.* and back is a circle."""
    arrows: dict[str, dict[str, str]] = {}  # node -> {node it imports: one module-level import that makes it}
    for mod, deps in sorted(imports(pkg_dir).items()):
        for dep, _ in sorted(deps):
            a, b = node(mod), node(dep)
            if a != b and pkg_dir.name not in (a, b):
                arrows.setdefault(a, {}).setdefault(b, f"{mod} -> {dep}")
    bad, seen = [], set()
    for start in sorted(arrows):
        stack = [(start, (start,))]
        while stack:
            here, path = stack.pop()
            for nxt in sorted(arrows.get(here, ())):
                if nxt == start:
                    if frozenset(path) not in seen:
                        seen.add(frozenset(path))
                        hops = zip(path, path[1:] + (start,), strict=True)
                        bad.append("package circle: " + "; ".join(arrows[a][b] for a, b in hops))
                elif nxt not in path and len(path) < 8:
                    stack.append((nxt, path + (nxt,)))
    return bad


def private_attributes(pkg_dir: Path) -> list[str]:
    """Uses of another package module's private attribute through the module object (`subsets._source(...)` where
    `subsets` is an imported module of the package); `__dunder__` names are public. The toy world's builder (the
    fixed benchmark) is exempt inside itself, as in `problems`."""
    pkg = pkg_dir.name
    mods = {".".join(p.relative_to(pkg_dir.parent).with_suffix("").parts): p for p in pkg_dir.rglob("*.py")}
    mods = {m.removesuffix(".__init__"): p for m, p in mods.items()}
    bad = []
    for mod, path in sorted(mods.items()):
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> the dotted name it stands for (a package module or above)
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] == pkg:
                        bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else pkg
            elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == pkg:
                bound.update({a.asname or a.name: f"{n.module}.{a.name}" for a in n.names})
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            parts, v = [], n.value
            while isinstance(v, ast.Attribute):
                parts.insert(0, v.attr)
                v = v.value
            if not isinstance(v, ast.Name) or v.id not in bound:
                continue
            target = ".".join([bound[v.id], *parts])
            toy = f"{pkg}.toy"
            if target in mods and target != mod and not (node(mod) == toy == node(target)):
                bad.append(f"private attribute: {mod} uses {target}.{n.attr} (line {n.lineno})")
    return bad


def test_eagle_lib_packages_import_each_other_one_way():
    assert package_circles(ROOT / "eagle_lib") == []


def test_eagle_lib_uses_no_private_attribute_of_another_module():
    assert private_attributes(ROOT / "eagle_lib") == []


def test_the_package_checks_see_each_kind(tmp_path):
    pkg = tmp_path / "pk"
    for d in ("low", "high", "toy"):
        (pkg / d).mkdir(parents=True)
    for f, text in {
        "__init__.py": "",
        "shared.py": "def f():\n    from pk.high import b\n",  # lazy, top-level module -> sub-package
        "low/__init__.py": "",
        "low/a.py": "_secret = 1\nopen_ = 2\n",
        "low/c.py": "from pk.high.b import g\n",  # low -> high, and high -> low: a package circle
        "high/__init__.py": "",
        "high/b.py": "import pk.shared\nfrom pk.low import a\nimport pk.low.a as aa\nimport pk\n\n"
        "def g():\n    return a._secret + aa._secret + pk.low.a._secret + a.open_ + a.__name__\n",
        "toy/__init__.py": "",
        "toy/t.py": "from pk.toy import u\nx = u._helper\n",  # the toy world, inside itself: exempt
        "toy/u.py": "_helper = 1\n",
    }.items():
        (pkg / f).write_text(text)
    circles = package_circles(pkg)
    assert len(circles) == 2, circles
    assert "package circle: pk.high.b -> pk.low.a; pk.low.c -> pk.high.b" in circles
    assert "package circle: pk.high.b -> pk.shared; pk.shared -> pk.high.b" in circles
    private = private_attributes(pkg)
    assert private == ["private attribute: pk.high.b uses pk.low.a._secret (line 7)"] * 3, private
