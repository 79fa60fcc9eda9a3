"""What the nodes install: a wheel of this very project, built here (so nodes run
the code that was launched), or a direct reference the user gives (--package).
A bare name is refused: the index resolves it to whatever is published under it,
and "bamboo" there is another project."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

from cloud.common import DISTRIBUTION, BadInput, LaunchError

DIRECT = ("https://", "http://", "git+", "file://")


def check_package(requirement: str) -> str:
    """`requirement` if it names where to get the code, else BadInput."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    text = requirement.strip()
    if text.startswith(DIRECT):
        return text
    try:
        parsed = Requirement(text)
    except InvalidRequirement as e:
        raise BadInput(f"--package {requirement!r} is not a pip requirement ({e})") from None
    if parsed.url:
        return text
    if canonicalize_name(parsed.name) == "bamboo":
        raise BadInput(f"--package {requirement!r}: 'bamboo' on the package index is an unrelated project; "
                       f"leave --package out to ship this project as a wheel")
    raise BadInput(f"--package {requirement!r}: a bare name installs whatever the package index holds under it "
                   f"({DISTRIBUTION} is not published there); give a wheel URL, NAME @ URL or git+URL, or leave "
                   f"--package out to ship this project as a wheel")


def project_root() -> str:
    """The source tree the running code comes from (its pyproject.toml names us)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cloud/package.py -> the checkout
    try:
        with open(os.path.join(root, "pyproject.toml")) as f:
            if f'name = "{DISTRIBUTION}"' in f.read():
                return root
    except OSError:
        pass
    raise BadInput(f"no {DISTRIBUTION} source tree beside {root} to build a wheel from (an installed copy): run "
                   f"bamboo-launch from a checkout, or give --package")


def build_wheel(out_dir: str | None = None) -> str:
    """A wheel of the project (pip wheel, no dependencies); its path."""
    root = project_root()
    out_dir = out_dir or tempfile.mkdtemp(prefix="bamboo-wheel-")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check",
                           "-w", out_dir, root], capture_output=True, text=True)
    wheels = glob.glob(os.path.join(out_dir, f"{DISTRIBUTION.replace('-', '_')}-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise LaunchError(f"building the wheel of {root} failed: {last}")
    return wheels[0]
