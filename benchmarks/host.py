"""The host a benchmark ran on, as every results file records it: lscpu's CPU model and
the flags that pick the CPU path's kernels (AVX2, FMA, AVX-512, AVX-VNNI, AMX).

    python benchmarks/host.py        # this host, as JSON (for the shell scripts)

The benchmark scripts import it as a sibling (`from host import describe`): they run as
`python benchmarks/NAME.py`, which puts this folder first on the path.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess

ISA = re.compile(r"^(avx2|fma|f16c|avx_vnni|avx512\w*|amx\w*)$")


def describe(lscpu: str | None = None) -> dict[str, str]:
    """{"cpu", "cpus", "isa"} from lscpu's output (this host's when None)."""
    if lscpu is None:
        try:
            lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        except OSError:
            lscpu = ""
    fields = {k.strip(): v.strip() for k, v in
              (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    return {"cpu": fields.get("Model name") or platform.processor() or "unknown CPU",
            "cpus": fields.get("CPU(s)", "?"),
            "isa": " ".join(f for f in fields.get("Flags", "").split() if ISA.match(f))}


if __name__ == "__main__":
    print(json.dumps(describe()))
