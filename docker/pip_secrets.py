"""The host's pip configuration, rewritten for `docker build --network host` (docker/test.sh).

A build sees none of the host's files, so the settings that name them are translated:
`cert` becomes the build secret `pip_cert` (/run/secrets/pip_cert), and each local
directory given as `find-links`, `index-url` or `extra-index-url` is served over HTTP on
loopback by test.sh and named by its URL. The host's `constraint` is left out: the
image pins what it installs. The result goes to the build as the secret `pip_conf`, read
by the two `pip install` steps only; nothing of it lands in a layer.

    python3 docker/pip_secrets.py OUT_DIR PORT

writes OUT_DIR/pip.conf, OUT_DIR/pip_cert (when a certificate is configured) and
OUT_DIR/files/ (links to the directories to serve on 127.0.0.1:PORT).
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

LOCATIONS = ("find-links", "index-url", "extra-index-url")
DROPPED = ("constraint", "requirement", "cache-dir", "log", "target", "prefix", "root")


def host_settings() -> dict[str, str]:
    """`pip config list`: one `scope.key='value'` per line; environment entries (`:env:`)
    come first, so the configuration files' values override them here as in pip."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True,
                         capture_output=True, text=True).stdout
    settings: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"^[^.]*\.([\w-]+)='(.*)'$", line)
        if m:
            settings[m.group(1)] = m.group(2)
    return settings


def main(out_dir: str, port: str) -> None:
    out, files = Path(out_dir), Path(out_dir) / "files"
    files.mkdir(parents=True, exist_ok=True)
    served: dict[Path, str] = {}

    def url(location: str) -> str:
        """A local directory (`/x` or `file:///x`) as a loopback URL; URLs unchanged."""
        path = Path(location.removeprefix("file://"))
        if "://" in location.removeprefix("file://") or not path.is_dir():
            return location
        parent = path.resolve().parent
        if parent not in served:  # a parent's link keeps an index's ../../files links working
            served[parent] = f"d{len(served)}"
            (files / served[parent]).symlink_to(parent)
        return f"http://127.0.0.1:{port}/{served[parent]}/{path.name}/"

    conf = configparser.ConfigParser()
    conf["global"] = {}
    for key, value in host_settings().items():
        if key in DROPPED:
            continue
        if key == "cert":
            shutil.copyfile(value, out / "pip_cert")
            value = "/run/secrets/pip_cert"
        elif key in LOCATIONS:
            value = " ".join(url(v) for v in value.split())
        conf["global"][key] = value
    with open(out / "pip.conf", "w") as f:
        conf.write(f)


if __name__ == "__main__":
    main(*sys.argv[1:])
