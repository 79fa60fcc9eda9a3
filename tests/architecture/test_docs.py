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


# Flags the docs name that belong to other programs: etcd and etcdctl (faults.md,
# security.md, HOTPATH.md), tensorboard, argparse's own --help, and the prefix
# --metrics-o that cloud.md shows argparse expanding.
OTHER_PROGRAMS = {"--cors", "--force-new-cluster", "--rev", "--unsafe-no-fsync", "--logdir", "--help", "--metrics-o"}
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def declared_flags() -> set[str]:
    """Every option string an add_argument call of ours declares (commands, scripts)."""
    found = set()
    for package in (*PACKAGES, "commands", "cloud", "scripts"):
        for path in (ROOT / package).rglob("*.py"):
            for call in re.finditer(r"add_argument\(\s*((?:\"-[^\"]*\"\s*[,)]\s*)+)", path.read_text()):
                found |= set(re.findall(r"\"(--[a-z0-9-]+)\"", call.group(1)))
    return found


def test_every_flag_the_docs_name_exists():
    """A flag renamed or removed in the code cannot live on in README.md or docs/."""
    declared, missing = declared_flags(), []
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for number, line in enumerate(page.read_text().splitlines(), 1):
            missing += [f"{page.name}:{number}: {flag}" for flag in FLAG.findall(line)
                        if flag not in declared and flag not in OTHER_PROGRAMS]
    assert len(declared) > 150 and not missing, missing


# boto3 operations whose IAM action is not their CamelCase name
S3_ACTIONS = {"head_object": "s3:GetObject", "get_object": "s3:GetObject", "put_object": "s3:PutObject",
              "delete_object": "s3:DeleteObject", "list_objects_v2": "s3:ListBucket", "head_bucket": "s3:ListBucket",
              "create_bucket": "s3:CreateBucket", "delete_bucket": "s3:DeleteBucket"}


def launch_policy() -> set[str]:
    """The actions cloud.md's launch policy allows."""
    import json
    text = (ROOT / "docs" / "cloud.md").read_text()
    policy = json.loads(text.split("```json\n", 1)[1].split("```", 1)[0])
    return {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}


def test_the_launch_policy_in_cloud_md_allows_every_call_the_launch_makes():
    """Every EC2 and Auto Scaling operation cloud/ec2.py sends, and every S3 operation
    of the launch's storage and checks, maps to an action the documented policy allows."""
    source = (ROOT / "cloud" / "ec2.py").read_text()
    wanted = {f"{service}:{''.join(w.title() for w in op.split('_'))}"
              for service, op in re.findall(r"_call\(\"(ec2|autoscaling)\", \"([a-z_]+)\"", source)}
    for path in (ROOT / "cloud" / "storage.py", ROOT / "bamboo" / "data" / "objects.py"):
        text = path.read_text()
        ops = set(re.findall(r"\.(head_object|get_object|put_object|delete_object|head_bucket|create_bucket|"
                             r"delete_bucket)\(", text)) | set(re.findall(r"_call\(\"([a-z_]+)\"", text))
        ops |= set(re.findall(r"get_paginator\(\"([a-z_0-9]+)\"\)", text))
        wanted |= {S3_ACTIONS[op] for op in ops if op in S3_ACTIONS}
    wanted.add("ec2:CreateTags")  # run_instances and the template tag what they make
    assert len(wanted) > 20 and sorted(wanted - launch_policy()) == []
