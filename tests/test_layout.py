"""The layout README.md promises: imports run one way (no loop among the project's modules, counting
imports inside functions too), and the kernels import no component and no backend."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")}
COMPONENTS = {"model", "model_v4", "config", "ops", "attention", "attention_v4", "compressor", "mhc", "indexer", "moe",
              "rope", "checkpoint", "chat", "generate",
              "verify", "parallel", "backend_torch"}


def imports(name):  # the project modules `name` imports, anywhere in its file
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return (found & MODULES.keys()) - {name}


def test_no_import_loop():
    graph = {m: imports(m) for m in MODULES}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import loop: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_kernels_and_numbers_import_no_component():
    for low in ("kernels_fp8", "kernels_cuda", "kernels_rocm", "quant", "quant_torch"):
        assert not imports(low) & COMPONENTS, (low, imports(low) & COMPONENTS)


def test_the_check_sees_a_loop(tmp_path, monkeypatch):
    # the checker itself: two modules importing each other are a loop
    for a, b in (("x_a", "x_b"), ("x_b", "x_a")):
        (tmp_path / f"{a}.py").write_text(f"def f():\n    import {b}\n")
    monkeypatch.setattr(__import__(__name__), "MODULES", {p.stem: p for p in tmp_path.glob("*.py")})
    try:
        test_no_import_loop()
    except AssertionError as e:
        assert "x_a -> x_b -> x_a" in str(e)
    else:
        raise AssertionError("the loop was not seen")
