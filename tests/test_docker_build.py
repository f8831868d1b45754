"""The CPU image built and run for real: docker/test.sh, opt-in (RIDGELINE_DOCKER_TEST=1).

It needs root, a Docker engine it may start itself, debootstrap and Docker Compose v2, and
takes minutes (docker/README.md gives the times), so the normal suite skips it:

    RIDGELINE_DOCKER_TEST=1 python -m pytest -q tests/test_docker_build.py -s
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.environ.get("RIDGELINE_DOCKER_TEST") != "1",
                    reason="builds and runs the image: set RIDGELINE_DOCKER_TEST=1")
def test_docker_image_built_and_run():
    r = subprocess.run([str(ROOT / "docker" / "test.sh")], capture_output=True, text=True,
                       timeout=3600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "ALL CHECKS PASSED" in out
    for line in ("events,", "KV usage", "HEALTHCHECK: healthy", "after docker stop: exited 0",
                 "read-only and served", "requests, all 200"):
        assert line in out, line
