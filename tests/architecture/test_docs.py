"""docs/ARCHITECTURE.md stays true: every `Class.method` and `module.function` it
names exists, every module of the packages appears in its layout by its path, and
every path it cites is a file of the tree."""
import importlib
import inspect
import pathlib
import pkgutil
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
PACKAGES = ("schedules", "bamboo", "agents", "sim")


def modules():
    """(path from the root, short name, module) of every module of the packages."""
    for package in PACKAGES:
        for info in pkgutil.walk_packages([str(ROOT / package)], f"{package}."):
            if not info.ispkg:
                path = info.name.replace(".", "/") + ".py"
                yield path, info.name.rpartition(".")[2], importlib.import_module(info.name)


def test_every_name_the_architecture_gives_exists():
    namespaces = {}
    for _, name, module in modules():
        namespaces.setdefault(name, []).append(module)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            namespaces.setdefault(cls_name, []).append(cls)
    named = set(re.findall(r"`(\w+)\.(\w+)`", DOC))
    checked = [(owner, attr) for owner, attr in named if owner in namespaces and attr != "py"]
    missing = [f"{owner}.{attr}" for owner, attr in checked
               if not any(hasattr(ns, attr) for ns in namespaces[owner])]
    assert len(checked) > 40 and missing == []


def test_every_module_is_on_the_map():
    absent = [path for path, name, _ in modules() if name != "__main__" and f"`{path}`" not in DOC]
    assert absent == []


def test_every_path_the_architecture_cites_exists():
    cited = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|toml))`", DOC))
    assert len(cited) > 40
    assert sorted(p for p in cited if not (ROOT / p).exists()) == []
