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


KERNEL_MODULES = ("kernels_fp8", "kernels_cuda", "kernels_moe", "kernels_v4", "kernels_rocm", "kernels_hopper")


def pdl_faults(tree):  # what breaks kernels_fp8.py's programmatic-dependent-launch rule in a module
    """Every @triton.jit (or @gluon.jit) function that no other one calls or names (a kernel, whatever
    its name; Gluon's partitions are named in the kernel's warp_specialize) waits for the kernel before
    it as its first statement; every launch, f[grid](...) whatever f is (a name, a variable, a module's
    attribute), passes **pdl()."""
    jit = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
           and any("jit" in ast.unparse(d) for d in n.decorator_list)}
    helpers = {c.id for f in jit.values() for c in ast.walk(f) if isinstance(c, ast.Name)}
    faults = []
    for name, node in jit.items():
        if name in helpers:
            continue
        body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
            else node.body
        if ast.unparse(body[0]) != "_await_inputs(PDL)" or "PDL" not in [a.arg for a in node.args.args]:
            faults.append(f"{name} does not wait first")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            if not any(k.arg is None and ast.unparse(k.value) == "pdl()" for k in node.keywords):
                faults.append(f"a launch of {ast.unparse(node.func.value)} without **pdl() (line {node.lineno})")
    return faults


def test_every_kernel_waits_first_and_every_launch_asks_for_dependent_launch():
    """Programmatic dependent launch lets a kernel start before the one before it has finished; that is
    safe only because every kernel waits (griddepcontrol.wait) before it touches memory."""
    kernels = 0
    for m in KERNEL_MODULES:
        tree = ast.parse(MODULES[m].read_text())
        kernels += sum(isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel") for n in ast.walk(tree))
        assert pdl_faults(tree) == [], (m, pdl_faults(tree))
    assert kernels >= 29                                  # the rule saw the kernels (29 on 2026-12-03)


def test_the_pdl_check_sees_kernels_that_read_before_waiting_and_plain_launches():
    def sub(text, *pairs):  # each replacement, once, where it applies
        for old, new in zip(pairs[::2], pairs[1::2]):
            assert old in text, old
            text = text.replace(old, new, 1)
        return text

    src = MODULES["kernels_moe"].read_text()
    launch, plain = "_route_kernel[(1,)](idx.contiguous(), rows,", ("num_warps=4, **pdl())\n    return rows",
                                                                  "num_warps=4)\n    return rows")
    first = "    _await_inputs(PDL)\n    m = tl.program_id(0)\n"
    mutants = [sub(src, first, "    m = tl.program_id(0)\n    _await_inputs(PDL)\n"),
               sub(src, ", **pdl())", ")"),
               sub(src, launch, "k = _route_kernel\n    k[(1,)](idx.contiguous(), rows,", *plain),  # a variable
               sub(src, launch, "kernels_moe._route_kernel[(1,)](idx.contiguous(), rows,", *plain),     # an attribute
               sub(src, "@triton.jit\ndef _route_kernel", "@triton.jit\ndef _route",                      # any name
                   "    _await_inputs(PDL)\n    for p0", "    for p0", launch, "_route[(1,)](idx.contiguous(), rows,")]
    for mutant in mutants:
        assert len(pdl_faults(ast.parse(mutant))) == 1, pdl_faults(ast.parse(mutant))
