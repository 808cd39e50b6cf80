"""The package's import graph (module-level and lazy imports alike) has no circles."""

import ast
from pathlib import Path

import trl_qerl


PACKAGE = Path(trl_qerl.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports anywhere in its body (a lazy import inside a function counts)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(candidate for candidate in candidates if candidate in modules)
    found.discard(name)
    # importing a submodule imports its package's __init__ too, but the package re-exporting it is not a circle
    return {module for module in found if not name.startswith(module + ".")}


def _graph() -> dict[str, set[str]]:
    paths = [path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts]
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return stack[stack.index(child) :] + [child]
            if child not in state and (found := visit(child, stack + [child])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_circles():
    graph = _graph()
    assert "trl_qerl.rollout.vllm_engine" in graph["trl_qerl.rollout.vllm_server"]
    assert _cycle(graph) is None


def test_the_vllm_trainer_backend_and_the_server_do_not_import_each_other():
    graph = _graph()
    assert "trl_qerl.rollout.vllm_server" not in graph["trl_qerl.rollout.vllm"]
    assert "trl_qerl.rollout.vllm" not in graph["trl_qerl.rollout.vllm_server"]


def test_the_kernel_ops_are_a_leaf_of_the_nvfp4_layer():
    graph = _graph()
    allowed = {"trl_qerl.nvfp4.format", "trl_qerl.nvfp4.cuda_mma", "trl_qerl.nvfp4.cuda_wgmma", "trl_qerl.nvfp4.nvrtc",
               "trl_qerl.nvfp4.lora_terms", "trl_qerl.nvfp4.twiddle", "trl_qerl.nvfp4._matmul_kernel",
               "trl_qerl.nvfp4._files"}  # fmt: skip
    assert not graph["trl_qerl.nvfp4.kernels"] - allowed
    assert not graph["trl_qerl.nvfp4._matmul_kernel"]
    assert not graph["trl_qerl.nvfp4.cuda_wgmma"] - {"trl_qerl.nvfp4.cuda_mma", "trl_qerl.nvfp4.nvrtc",
                                                     "trl_qerl.nvfp4.twiddle"}  # fmt: skip
    assert not graph["trl_qerl.nvfp4.cuda_mma"] - {"trl_qerl.nvfp4.nvrtc", "trl_qerl.nvfp4.twiddle"}
    assert not graph["trl_qerl.nvfp4.nvrtc"] - {"trl_qerl.nvfp4._files"}
    # whole-file writes: standard library only, shared by the kernel table, the cubin cache and the checkpoints
    assert not graph["trl_qerl.nvfp4._files"]
    # the code order and its window: below every reader of the codes (its Triton pass is a leaf of its own)
    assert not graph["trl_qerl.nvfp4.twiddle"] - {"trl_qerl.nvfp4._twiddle_kernel"}
    assert not graph["trl_qerl.nvfp4._twiddle_kernel"]
