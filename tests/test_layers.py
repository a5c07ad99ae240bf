"""The layering of ARCHITECTURE.md holds: import-linter's contracts (pyproject.toml), and the
compute layers (kvf.pipeline.model, kvf.pipeline.fusion) open no files themselves."""
import ast
from pathlib import Path

import kvf

ROOT = Path(kvf.__file__).parent
FILE_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "mkdir", "unlink", "rename", "replace",
              "save", "load", "savez", "fromfile", "tofile", "rmtree", "makedirs", "remove", "mkstemp", "mkdtemp"}
FILE_MODULES = {"os", "shutil", "tempfile", "pathlib", "io", "h5py", "zarr", "fsspec", "pickle"}


def test_import_linter_contracts_are_kept():
    from importlinter.cli import lint_imports
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def file_operations(path: Path) -> list[str]:
    """Calls and imports in a module that touch files."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            # torch.load / np.save and friends; tensor.save-like methods on model objects are not file IO
            if name in FILE_CALLS and (owner in ("", "os", "np", "numpy", "torch", "shutil", "tempfile", "Path", "json")
                                       or name in ("open", "read_text", "write_text", "read_bytes", "write_bytes")):
                found.append(f"{path.name}:{node.lineno} {owner + '.' if owner else ''}{name}()")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path.name}:{node.lineno} import {m}" for m in modules if m.split(".")[0] in FILE_MODULES]
    return found


def test_model_and_fusion_open_no_files():
    modules = sorted((ROOT / "pipeline" / "model").rglob("*.py")) + sorted((ROOT / "pipeline" / "fusion").rglob("*.py"))
    assert len(modules) > 10
    offenders = [op for path in modules if path.name != "base.py" for op in file_operations(path)]
    # the registry (fusion/methods/base.py) imports method files by path, its one job that touches the disk
    registry = [op for op in file_operations(ROOT / "pipeline" / "fusion" / "methods" / "base.py")
                if "import os" not in op and "import pathlib" not in op]
    assert offenders == [] and registry == []
