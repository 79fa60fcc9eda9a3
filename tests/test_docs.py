"""docs/ARCHITECTURE.md stays true: every `Class.method` and `module.function` it
names exists, and every module of the packages appears in its layout."""
import importlib
import inspect
import pathlib
import pkgutil
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
PACKAGES = ("schedules", "bamboo", "agents", "sim")


def modules():
    for package in PACKAGES:
        for info in pkgutil.iter_modules([str(ROOT / package)]):
            yield package, info.name, importlib.import_module(f"{package}.{info.name}")


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
    absent = [f"{package}/{name}.py" for package, name, _ in modules()
              if name != "__main__" and f"`{name}.py`" not in DOC]
    assert absent == []
