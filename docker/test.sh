#!/usr/bin/env bash
# Build the CPU image from nothing and check it as a user would (docker/README.md, "What was
# checked"). As root, from anywhere:
#
#   docker/test.sh
#
# Starts dockerd (--iptables=false --bridge=none) when none answers; makes the local base
# image (debootstrap minbase bookworm, docker import) when it is missing; builds the CPU
# image with the host's pip configuration as build secrets (docker/pip_secrets.py); then
# runs the checks in docker/checks.py against containers on the host's network, and the
# compose "router" profile. On exit it removes the containers, volumes and compose project
# it made and stops the dockerd it started; the images stay, so a second run builds from
# cache. Prints how long each part took; exits 0 when every check passed.
#
# Needs: dockerd (Debian's docker.io), debootstrap, python3, apt; Docker Compose v2.24+
# (`docker compose`, or a v2 `docker-compose`) where there is one, else Debian's is
# fetched for the run (`fetch_compose`). Environment: RIDGELINE_TEST_IMAGE (ridgeline:cpu),
# RIDGELINE_TEST_BASE (ridgeline-base:bookworm), DEBIAN_MIRROR (http://deb.debian.org/debian).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
IMAGE=${RIDGELINE_TEST_IMAGE:-ridgeline:cpu}
BASE=${RIDGELINE_TEST_BASE:-ridgeline-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH=${RIDGELINE_TEST_TORCH:-torch==2.13.0+cpu}
PROJECT=ridgeline-test
WORK=$(mktemp -d /tmp/ridgeline-docker-test.XXXXXX)
chmod 755 "$WORK"  # the container's user reads the exported model from here
CHECK=(python3 "$ROOT/docker/checks.py")

DOCKERD_PID="" HTTP_PID="" COMPOSE_UP="" CONTAINERS=() TIMES=()
COMPOSE_FILES=(-f docker/compose.yaml -f docker/compose.cpu.yaml -f "$WORK/ports.yaml")

log() { printf '\n== %s\n' "$*"; }

cleanup() {
  local rc=$?
  set +e
  if [[ $rc != 0 ]]; then
    for c in "${CONTAINERS[@]}"; do
      echo "--- docker logs $c (last 20 lines)"; docker logs "$c" 2>&1 | tail -20
    done
  fi
  [[ -n $COMPOSE_UP ]] && "${COMPOSE[@]}" -p "$PROJECT" "${COMPOSE_FILES[@]}" --profile router \
    down -v --remove-orphans --timeout 5 >/dev/null 2>&1
  for c in "${CONTAINERS[@]}"; do docker rm -fv "$c" >/dev/null 2>&1; done
  [[ -n $HTTP_PID ]] && kill "$HTTP_PID" 2>/dev/null
  if [[ -n $DOCKERD_PID ]]; then
    kill "$DOCKERD_PID"; wait "$DOCKERD_PID" 2>/dev/null
  fi
  rm -rf "$WORK"
  if ((${#TIMES[@]})); then
    echo; echo "part | seconds"; echo "--- | ---"; printf '%s\n' "${TIMES[@]}"
  fi
  if [[ $rc == 0 ]]; then echo "ALL CHECKS PASSED"; else echo "FAILED (exit $rc)"; fi
  exit "$rc"
}
trap cleanup EXIT

# part NAME COMMAND...: run it, and record how long it took.
part() {
  local name=$1 t0=$SECONDS
  shift
  log "$name"
  "$@"
  TIMES+=("$name | $((SECONDS - t0))")
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_dockerd() {
  if docker info >/dev/null 2>&1; then echo "dockerd already running"; return; fi
  dockerd --iptables=false --bridge=none >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  tail -20 "$WORK/dockerd.log"; return 1
}

make_base() {
  if docker image inspect "$BASE" >/dev/null 2>&1; then echo "$BASE exists"; return; fi
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log"
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE"
  rm -rf "$WORK/rootfs"
}

# BuildKit: `docker buildx` where installed, else a client that still has BuildKit built in
# (Debian's docker.io 20.10, whose `docker` may sit behind a newer client without buildx).
builder() {
  if docker buildx version >/dev/null 2>&1; then BUILD=(docker buildx build --load); return; fi
  local c
  for c in $(type -ap docker); do
    if [[ $("$c" --version) =~ version\ (1[0-9]|2[0-2])\. ]]; then
      BUILD=(env DOCKER_BUILDKIT=1 "$c" build); return
    fi
  done
  echo "no BuildKit client: install docker-buildx, or Debian's docker.io" >&2; return 1
}

build() {
  builder
  local port secrets=()
  port=$(free_port)
  python3 docker/pip_secrets.py "$WORK/pip" "$port"
  python3 -m http.server "$port" --bind 127.0.0.1 --directory "$WORK/pip/files" \
    >"$WORK/http.log" 2>&1 &
  HTTP_PID=$!
  secrets+=(--secret "id=pip_conf,src=$WORK/pip/pip.conf")
  [[ -f $WORK/pip/pip_cert ]] && secrets+=(--secret "id=pip_cert,src=$WORK/pip/pip_cert")
  nice -n 19 "${BUILD[@]}" --progress plain --network host "${secrets[@]}" \
    --build-arg BASE="$BASE" --build-arg TORCH="$TORCH" --build-arg TORCH_INDEX_URL= \
    -t "$IMAGE" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; return 1; }
  # Each step's seconds: "#N [i/n] INSTRUCTION ..." then, later, "#N DONE 12.3s".
  awk '/^#[0-9]+ \[ *[0-9]+\/[0-9]+\] / {n = $1; sub(/^#[0-9]+ /, ""); step[n] = substr($0, 1, 48)}
       $2 == "DONE" && ($1 in step) {printf "%-48s %s\n", step[$1], $3}' "$WORK/build.log"
  kill "$HTTP_PID"; HTTP_PID=""
}

no_host_config_in_image() {
  local out
  out=$(docker run --rm --entrypoint sh "$IMAGE" -c \
    'pip config list; ls -A /run/secrets; ls /etc/pip.conf /etc/xdg/pip 2>/dev/null; true')
  echo "$out"
  if grep -E 'cert|index-url|find-links|pip_conf|pip_cert|pip.conf|xdg' <<<"$out"; then
    echo "FAIL: the host's pip configuration is in the image"; return 1
  fi
}

# serve NAME PORT [docker run options and image arguments...]
serve() {
  local name=$1 port=$2
  shift 2
  local opts=() args=()
  while (($#)) && [[ $1 != -- ]]; do opts+=("$1"); shift; done
  (($#)) && shift && args=("$@")
  CONTAINERS+=("$name")
  docker run -d --name "$name" --network host -e RIDGELINE_PORT="$port" "${opts[@]}" \
    "$IMAGE" "${args[@]}" >/dev/null
  "${CHECK[@]}" ready "http://127.0.0.1:$port" 600
}

non_root() {
  local uid
  uid=$(docker exec "$1" id -u)
  echo "the server runs as uid $uid"
  [[ $uid != 0 ]]
}

healthy() {
  local status
  for _ in $(seq 60); do
    status=$(docker inspect --format '{{.State.Health.Status}}' "$1")
    if [[ $status == healthy ]]; then echo "HEALTHCHECK: healthy"; return; fi
    sleep 2
  done
  echo "FAIL: HEALTHCHECK says $status"; return 1
}

drains() {
  "${CHECK[@]}" drain "http://127.0.0.1:$2" "$1"
  local code
  code=$(docker inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$1")
  echo "after docker stop: $code"
  [[ $code == "exited 0" ]]
}

read_only_model() {
  local port
  port=$(free_port)
  if python3 -c 'import app.cli, torch' 2>/dev/null; then
    python3 -m app.cli export-model "$WORK/model"
  else  # no engine on the host: the image exports it, as the host's user
    docker run --rm --user "$(id -u):$(id -g)" -v "$WORK:/out" --entrypoint ridgeline \
      "$IMAGE" export-model /out/model
  fi
  chmod -R a+rX "$WORK/model"
  serve ridgeline-test-model "$port" -v "$WORK/model:/models/x:ro" -- --model /models/x
  "${CHECK[@]}" complete "http://127.0.0.1:$port" /models/x
  if docker exec ridgeline-test-model touch /models/x/written 2>/dev/null; then
    echo "FAIL: /models/x is writable"; return 1
  fi
  echo "/models/x is mounted read-only and served"
  docker rm -fv ridgeline-test-model >/dev/null
}

compose_cmd() {
  if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
  elif [[ $(docker-compose version 2>/dev/null) =~ v2\. ]]; then COMPOSE=(docker-compose)
  else fetch_compose; COMPOSE=("$WORK/compose/usr/libexec/docker/cli-plugins/docker-compose")
  fi
  "${COMPOSE[@]}" version
}

# fetch_compose: Debian's own Compose v2 (trixie's package: bookworm has only v1, which
# cannot read the compose files' `!reset`), fetched and checked by apt against the
# archive's signed index, unpacked into $WORK and run standalone. apt reads a sources
# list and lists of its own here, so the host's sources and packages stay as they were.
fetch_compose() {
  local apt="$WORK/apt"
  mkdir -p "$apt/lists/partial" "$apt/archives/partial"
  echo "deb $MIRROR trixie main" >"$apt/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache::Archives=$apt/archives"
              -o APT::Sandbox::User=root)
  echo "no Docker Compose v2 here: fetching Debian trixie's docker-compose into $WORK"
  apt-get "${opts[@]}" update -q >/dev/null
  (cd "$apt" && apt-get "${opts[@]}" download -q docker-compose >/dev/null 2>&1)
  dpkg-deb -x "$apt"/docker-compose_*.deb "$WORK/compose"
}

# served SERVICE: the completions one replica finished, read from its /metrics in place.
served() {
  "${COMPOSE[@]}" -p "$PROJECT" "${COMPOSE_FILES[@]}" exec -T "$1" python -c \
    "import re, urllib.request; t = urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode(); print(int(sum(float(v) for v in re.findall(r'^ridgeline:request_success_total{[^}]*\"length\"[^}]*} (\S+)$', t, re.M))))"
}

router_profile() {
  local port busy idle before model
  port=$(free_port)
  # The test's own ports: the router on a free loopback port, the replicas unpublished.
  cat >"$WORK/ports.yaml" <<EOF
services:
  ridgeline: {image: "$IMAGE", ports: !reset []}
  ridgeline-2: {image: "$IMAGE"}
  router: {image: "$IMAGE", ports: !override ["127.0.0.1:$port:30000"]}
EOF
  COMPOSE_UP=1
  "${COMPOSE[@]}" -p "$PROJECT" "${COMPOSE_FILES[@]}" --profile router up -d --no-build --wait
  "${COMPOSE[@]}" -p "$PROJECT" "${COMPOSE_FILES[@]}" --profile router ps
  "${CHECK[@]}" requests "http://127.0.0.1:$port" 8
  # The router sends /v1/models to one replica without a retry: ask while both are up.
  model=$("${CHECK[@]}" model "http://127.0.0.1:$port")
  # Lose the replica that took the traffic: the other must take all of it from then on.
  if (($(served ridgeline) >= $(served ridgeline-2))); then busy=ridgeline idle=ridgeline-2
  else busy=ridgeline-2 idle=ridgeline; fi
  before=$(served "$idle")
  log "router: stop $busy (it served $(served "$busy") of 8, $idle $before)"
  "${COMPOSE[@]}" -p "$PROJECT" "${COMPOSE_FILES[@]}" stop "$busy"
  "${CHECK[@]}" requests "http://127.0.0.1:$port" 16 "$model"
  echo "$idle served $(($(served "$idle") - before)) of the 16 after the loss"
  (($(served "$idle") - before == 16))
  "${COMPOSE[@]}" -p "$PROJECT" "${COMPOSE_FILES[@]}" --profile router down -v --timeout 30
  COMPOSE_UP=""
}

part "dockerd" start_dockerd
part "base image" make_base
part "build the CPU image" build
docker image ls "$IMAGE"
part "no pip configuration in the image" no_host_config_in_image

PORT=$(free_port)
B=http://127.0.0.1:$PORT
part "docker run: start to ready" serve ridgeline-test-main "$PORT" --stop-timeout 60
part "non-root" non_root ridgeline-test-main
part "completion of the embedded model" "${CHECK[@]}" complete "$B"
part "SSE event by event" "${CHECK[@]}" stream "$B"
part "abort on disconnect" "${CHECK[@]}" abort "$B"
part "HEALTHCHECK healthy" healthy ridgeline-test-main
part "docker stop drains" drains ridgeline-test-main "$PORT"
part "read-only model mount" read_only_model
part "compose" compose_cmd
part "compose router profile, one replica lost" router_profile
