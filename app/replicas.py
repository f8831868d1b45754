"""`ridgeline replicas`: N `ridgeline serve` replicas on free ports, vllm-router in front.

Ridgeline does not grow a balancer of its own: vllm-router (Rust, `pip install
vllm-router`) balances OpenAI-compatible workers with round_robin, power_of_two,
cache_aware (a radix tree of the token ids each replica was sent, from our
`/v1/*/render` endpoints) and kv_aware (what each replica's prefix cache really
holds, from the KV events each replica publishes), with retries, circuit breakers
and health checks. This starts the replicas, waits for them, starts the router with
settings that suit a small pool, and on SIGTERM/SIGINT stops the router and then
drains every replica (each finishes what it holds, `--shutdown-timeout`).

    ridgeline replicas --replicas 2 --policy cache_aware -- --model DIR --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

POLICIES = ("round_robin", "cache_aware", "kv_aware", "power_of_two", "random")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str, path: str = "/health", timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Replica:
    port: int
    args: list[str]
    kv_events_port: int | None = None
    process: subprocess.Popen | None = None
    log_path: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        if self.kv_events_port is not None:
            cmd += ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": '
                    f'"tcp://127.0.0.1:{self.kv_events_port}"}}']
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(cmd, stdout=log, stderr=log)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@dataclass
class Cluster:
    """Replicas and the router, as a context manager (the tests use it the same way)."""

    replicas: int = 2
    policy: str = "cache_aware"
    serve_args: list[str] = field(default_factory=list)
    router_port: int = 0
    log_dir: str | None = None
    startup_timeout: float = 300.0
    nodes: list[Replica] = field(default_factory=list)
    router: subprocess.Popen | None = None
    router_metrics_port: int = 0  # the router's own Prometheus endpoint

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def start(self) -> Cluster:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        kv = self.policy == "kv_aware"
        for i in range(self.replicas):
            replica = Replica(free_port(), list(self.serve_args),
                              free_port() if kv else None,
                              log_path=self._log(f"replica{i}.log"))
            replica.start()
            self.nodes.append(replica)
        self._wait(lambda: all(healthy(n.url) for n in self.nodes), "replicas")
        self.router_port = self.router_port or free_port()
        self.router_metrics_port = free_port()
        cmd = ["vllm-router", "--host", "127.0.0.1", "--port", str(self.router_port),
               "--policy", self.policy, "--worker-urls", *[n.url for n in self.nodes],
               "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "2", "--health-success-threshold", "1",
               "--prometheus-port", str(self.router_metrics_port),
               # A small CPU pool: balance when 4 more requests sit on one replica, not 64.
               "--balance-abs-threshold", "4", "--log-level", "warning"]
        if kv:
            args = self.serve_args
            size = args[args.index("--block-size") + 1] if "--block-size" in args else "16"
            for n in self.nodes:
                cmd += ["--kv-event-source", f"{n.url}=tcp://127.0.0.1:{n.kv_events_port}"]
            name = (args[args.index("--served-model-name") + 1]
                    if "--served-model-name" in args else "ridgeline")
            cmd += ["--kv-event-block-size", size, "--kv-event-model", name]
        log = open(self._log("router.log"), "ab") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
        self.router = subprocess.Popen(cmd, stdout=log, stderr=log)
        self._wait(lambda: healthy(self.url, "/readiness"), "router")
        return self

    def _log(self, name: str) -> str | None:
        if not self.log_dir:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        return os.path.join(self.log_dir, name)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not ready():
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{what} did not become healthy")
            exited = [p for p in [*(n.process for n in self.nodes), self.router]
                      if p is not None and p.poll() is not None]
            if exited:
                self.stop()
                raise RuntimeError(f"{' '.join(exited[0].args[:3])} exited while starting "
                                   f"(logs: {self.log_dir or 'pass --log-dir'})")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        for n in self.nodes:  # SIGTERM: each drains what it holds, then exits
            if n.process is not None and n.process.poll() is None:
                n.process.send_signal(signal.SIGTERM)
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policy", default="cache_aware", choices=POLICIES)
    p.add_argument("--port", type=int, default=30000, help="the router's port")
    p.add_argument("--log-dir", default=None, help="one log file per replica and the router")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: flags for every `ridgeline serve` replica")


def run(a: argparse.Namespace) -> int:
    args = a.serve_args[1:] if a.serve_args[:1] == ["--"] else a.serve_args
    cluster = Cluster(a.replicas, a.policy, args, a.port, a.log_dir).start()
    print(f"router {cluster.url} ({a.policy}) -> " + " ".join(n.url for n in cluster.nodes),
          flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    while not stopping and cluster.router.poll() is None:
        time.sleep(0.5)
    cluster.stop()
    return 0
