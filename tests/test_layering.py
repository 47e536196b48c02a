"""The folder layout is the architecture: services meet only through protos/,
the shared plumbing (speclane/) imports no service, and only the command line
(speclane_cli/) may import them all. Checked on every import statement,
including those inside functions."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = {"drafter_service", "verifier_service", "gateway", "protos", "speclane", "speclane_cli"}
# package -> project packages it may import (itself included)
ALLOWED = {
    "protos": {"protos"},
    "speclane": {"speclane", "protos"},
    "drafter_service": {"drafter_service", "speclane", "protos"},
    "verifier_service": {"verifier_service", "speclane", "protos"},
    "gateway": {"gateway", "speclane", "protos"},
}
# Libraries a service must not even mention: the drafter runs where there is no torch.
FORBIDDEN_LIBRARIES = {"drafter_service": {"torch", "transformers"}, "gateway": {"torch"}}


def imported_modules(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def package_files(package: str) -> list[pathlib.Path]:
    generated = ("_pb2.py", "_pb2_grpc.py")
    return sorted(path for path in (ROOT / package).rglob("*.py") if not path.name.endswith(generated))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_allows(package):
    wrong = []
    for path in package_files(package):
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in PROJECT_PACKAGES - ALLOWED[package] or top in FORBIDDEN_LIBRARIES.get(package, ()):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_function_level_imports(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from verifier_service.engine import Engine\n")
    assert "verifier_service.engine" in imported_modules(source)


def test_no_two_test_files_share_a_name():
    """A failure's file name alone says which test it is (tests/README.md)."""
    names = [path.name for path in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []
