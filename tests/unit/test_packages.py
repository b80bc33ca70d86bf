"""The packages show the architecture (docs/architecture.md, "Packages"): imports point down only, read
from every module's source (imports inside functions included), and every package says in its
``__init__`` what lives there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# top-level package -> the top-level packages it may import
ALLOWED = {
    "wire": set(),
    "engine": {"wire"},
    "workers": {"wire"},
    "app": {"wire", "engine", "workers"},
}
# app's subpackages, bottom first: each may import the shared modules and those before it
APP_LAYERS = ["media", "inputs", "api", "proxy", "ray_serve", "launch"]
APP_SHARED = {"errors", "settings", "metrics", "sqlite_file", "child_processes", "fork_server_init"}


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", list(ALLOWED))
def test_imports_point_down_only(package: str) -> None:
    ours = set(ALLOWED)
    wrong = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sources(package)
        for module in imported_modules(path)
        if (top := module.split(".")[0]) in ours and top != package and top not in ALLOWED[package]
    }
    assert not wrong, sorted(wrong)


def test_app_subpackages_are_layered() -> None:
    wrong = set()
    for index, layer in enumerate(APP_LAYERS):
        allowed = APP_SHARED | set(APP_LAYERS[: index + 1])
        for path in sources(f"app/{layer}"):
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[0] == "app" and len(parts) > 1 and parts[1] not in allowed:
                    wrong.add(f"{path.relative_to(ROOT)} imports {module}")
    for shared in APP_SHARED:
        path = ROOT / "app" / f"{shared}.py"
        wrong |= {f"app/{shared}.py imports {m}" for m in imported_modules(path) if m.startswith("app.")}
    assert not wrong, sorted(wrong)


def test_every_package_says_what_lives_there() -> None:
    missing = [
        str(init.relative_to(ROOT))
        for package in ALLOWED
        for init in (ROOT / package).rglob("__init__.py")
        if not ast.get_docstring(ast.parse(init.read_text()))
    ]
    assert not missing, missing
