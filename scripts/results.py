"""What the benchmark and simulator scripts share: writing their results file
whole or not at all (a temp file beside it, then a rename)."""
from __future__ import annotations

import json
import os
import tempfile


def write_json(path: str, data) -> None:
    """`data` as indented JSON at `path`: a reader sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=".results-", suffix=".json", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
