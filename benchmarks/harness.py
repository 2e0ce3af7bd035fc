"""Writing a benchmark's JSON result: the one helper every script in this folder uses."""

import json
import os
from pathlib import Path


def write_json(path: "str | os.PathLike", payload, **dump_options) -> Path:
    """Writes ``payload`` as indented JSON to ``path`` through a temporary file and a
    rename, so an interrupted run never leaves half a file; creates the folder.

    Example:
        >>> import tempfile
        >>> p = write_json(Path(tempfile.mkdtemp()) / "r" / "x.json", {"a": 1})
        >>> json.loads(p.read_text())
        {'a': 1}
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, **dump_options))
    os.replace(tmp, path)
    return path
