"""Where `ridgeline bench serve` writes its result, with `vllm bench serve`'s flags.

`--label` names the run (in the JSON, and as the file name's prefix), `--metadata
KEY=VALUE` adds fields for record keeping, `--append-result` adds the run as one JSON
line to the file instead of replacing it (a sweep collects its runs in one file), and
`--save-detailed` adds each request's generated text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """`["a=1", "b=x=y"]` → {"a": "1", "b": "x=y"}; a ValueError names the flag."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def result_path(a: argparse.Namespace) -> Path:
    name = a.result_filename or (f"{a.label}-serve.json" if a.label else "serve.json")
    return Path(a.result_dir) / name


def write_result(a: argparse.Namespace, result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not a.append_result:
        path.write_text(json.dumps(result, indent=1))
        return
    with path.open("a+", encoding="utf-8") as f:
        if f.tell() != 0:
            f.write("\n")
        f.write(json.dumps(result))
