#!/usr/bin/env bash
# Build the gpu-server image and run it for real (docs/deploy.md), on a machine that cannot pull from an image
# registry: a local Debian base image (debootstrap + docker import), the CPU torch wheel and the other wheels
# through the build context (docker/wheels/), the server container on the host network, a training with a faulty
# kernel on the host against 127.0.0.1 only. Checks: the container runs as non-root, its HEALTHCHECK (the gRPC
# health service) turns healthy, SIGTERM drains it with exit status 0, the reports (CSV, JSON, HTML) are in the
# mounted /out and flag exactly the faulty API.
#
# Needs root (installs docker.io and debootstrap with apt-get when missing, starts dockerd when none runs).
# The base image and the wheels are cached between runs; DOCKER_TEST_REBUILD=1 rebuilds the base image.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
T0=$(date +%s)
say() { echo "[docker/test.sh +$(( $(date +%s) - T0 ))s] $*"; }
die() { echo "[docker/test.sh] FAILED: $*" >&2; exit 1; }

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
SUITE=${DOCKER_TEST_SUITE:-bookworm}          # Debian bookworm ships Python 3.11
BASE=online-check/base:$SUITE-py3
IMAGE=online-check/gpu-server:test
NAME=online-check-test-$$

# -- tools ---------------------------------------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  [ "$(id -u)" = 0 ] || die "docker.io and debootstrap are missing and this is not root"
  say "installing docker.io and debootstrap (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
export DOCKER_BUILDKIT=0       # the classic builder: no buildx plugin, nothing pulled
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd --bridge=none --iptables=false (log /tmp/online-check-dockerd.log)"
  nohup dockerd --bridge=none --iptables=false >/tmp/online-check-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || die "dockerd did not start: $(tail -20 /tmp/online-check-dockerd.log)"
fi

# -- base image: debootstrap minbase + python3, imported (cached) ---------------------------------------------
if [ -n "${DOCKER_TEST_REBUILD:-}" ] || ! docker image inspect "$BASE" >/dev/null 2>&1; then
  MIRROR=$(grep -rhoE '^(deb|URIs:)[[:space:]]+[a-z]+://[^[:space:]]+/debian/?([[:space:]]|$)' \
             /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | awk '{print $2}' | head -1 || true)
  [ -n "$MIRROR" ] || die "no Debian mirror found in /etc/apt/sources.list*; set one there first"
  ROOTFS=$(mktemp -d /tmp/online-check-rootfs.XXXXXX)
  say "debootstrap --variant=minbase $SUITE (python3, python3-venv) from the apt mirror"
  debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$ROOTFS" "$MIRROR" \
    >/tmp/online-check-debootstrap.log 2>&1 || die "debootstrap failed: $(tail -20 /tmp/online-check-debootstrap.log)"
  for m in proc sys dev/pts dev; do umount "$ROOTFS/$m" 2>/dev/null || true; done
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  tar -C "$ROOTFS" --one-file-system -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$BASE" >/dev/null
  rm -rf --one-file-system "$ROOTFS"
fi
BASEPY=$(docker run --rm --network none "$BASE" python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[ "$BASEPY" = "$PYVER" ] || die "the base image has Python $BASEPY but $PY is $PYVER: the wheels would not fit"

# -- wheels through the build context (cached; refreshed when pyproject.toml changes) -------------------------
STAMP=docker/wheels/.pyproject.sha256
if [ ! -f "$STAMP" ] || ! sha256sum -c --status "$STAMP" 2>/dev/null; then
  say "collecting wheels into docker/wheels (CPU torch 2.13.0, the project's dependencies, setuptools)"
  find docker/wheels -name '*.whl' -delete
  "$PY" -m pip wheel -q --disable-pip-version-check -w docker/wheels torch==2.13.0 'setuptools>=64' wheel '.[fast]' \
    || die "pip wheel failed"
  rm -f docker/wheels/online_accuracy_checker-*.whl     # the project itself is built from the source in the image
  sha256sum pyproject.toml >"$STAMP"
fi

# -- the image -----------------------------------------------------------------------------------------------
say "docker build -f docker/Dockerfile.server --build-arg BASE=$BASE"
B0=$(date +%s)
docker build -q -f docker/Dockerfile.server --build-arg BASE="$BASE" -t "$IMAGE" . >/tmp/online-check-build.log 2>&1 \
  || die "docker build failed: $(tail -40 /tmp/online-check-build.log)"
say "image built in $(( $(date +%s) - B0 )) s"
docker image inspect "$IMAGE" --format '{{.Config.User}} {{json .Config.Healthcheck.Test}}' | grep -q '^10001:10001 ' \
  || die "the image does not run as user 10001"

# -- run it: server in the container on the host network, training on the host on 127.0.0.1 -----------------
WORK=$(mktemp -d /tmp/online-check-docker.XXXXXX)
cleanup() { docker rm -f "$NAME" "$NAME-tls" >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$WORK/config" "$WORK/out"
chown 10001:10001 "$WORK/out"
cat >"$WORK/config/server.json" <<JSON
{"task": "run_ut", "run_ut": {"white_list": [], "black_list": [], "error_data_path": "./", "is_online": true,
 "nfs_path": "", "host": "127.0.0.1", "port": $PORT, "rank_list": [], "tls_path": ""}}
JSON
cat >"$WORK/agent.json" <<JSON
{"task": "tensor", "dump_path": "$WORK/dump", "level": "L1", "rank": [], "step": [],
 "tensor": {"scope": [], "list": [], "online_run_ut": true, "nfs_path": "", "host": "127.0.0.1", "port": $PORT,
            "tls_path": "", "online_run_ut_recompute": false}}
JSON
say "docker run --network host $IMAGE (port $PORT)"
docker run -d --name "$NAME" --network host -e OMP_NUM_THREADS=1 -e GPU_SERVER_HEALTH_PORT="$PORT" \
  --health-interval 2s --health-start-period 60s \
  -v "$WORK/config:/config:ro" -v "$WORK/out:/out" "$IMAGE" \
  --config /config/server.json --out /out >/dev/null
for _ in $(seq 120); do
  STATE=$(docker inspect -f '{{.State.Health.Status}} {{.State.Running}}' "$NAME")
  case "$STATE" in healthy*) break ;; *false) die "the container exited: $(docker logs "$NAME" 2>&1 | tail -30)" ;; esac
  sleep 1
done
[ "${STATE%% *}" = healthy ] || die "the health check never passed ($STATE): $(docker inspect -f '{{json .State.Health}}' "$NAME")"
say "HEALTHCHECK: healthy ($(docker inspect -f '{{range .State.Health.Log}}{{.Output}}{{end}}' "$NAME" | grep SERVING | tail -1))"
PROBE=$(docker exec "$NAME" gpu-server health --host 127.0.0.1 --port "$PORT") || die "gpu-server health failed: $PROBE"
[[ "$PROBE" == *SERVING ]] || die "gpu-server health answered: $PROBE"
UID_IN=$(docker exec "$NAME" id -u)
[ "$UID_IN" != 0 ] || die "the server runs as root in the container"
say "the server runs as uid $UID_IN"
say "training TinyLM (1 step, bfloat16) with a faulty gelu kernel on the host against 127.0.0.1:$PORT"
OMP_NUM_THREADS=1 RANK=0 PYTHONPATH="$ROOT" "$PY" -c "from tests.faulty_kernels import main; main()" \
  --config "$WORK/agent.json" --model tinylm --dtype bfloat16 --case gelu_forward --steps 1 \
  || die "the training failed"
say "docker stop (SIGTERM: the server drains and writes its reports)"
docker stop -t 300 "$NAME" >/dev/null
CODE=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
[ "$CODE" = 0 ] || die "the server exited with $CODE: $(docker logs "$NAME" 2>&1 | tail -30)"
docker logs "$NAME" 2>&1 | sed -n '/gpu-server summary/,$p' | head -20

# -- the reports -----------------------------------------------------------------------------------------------
"$PY" - "$WORK/out" <<'PY'
import glob, os, sys
sys.path.insert(0, os.getcwd())
from tests.faulty_kernels import flagged
out = sys.argv[1]
for kind in ("accuracy_checking_result", "accuracy_checking_details", "api_precision_compare_result",
             "api_precision_compare_details"):
    assert glob.glob(os.path.join(out, f"{kind}_*_rank0.csv")), f"no {kind} report in {out}"
assert glob.glob(os.path.join(out, "summary_*.json")), "no summary json"
got = flagged(out, 0, "api_precision_compare_result")
want = {("Functional.gelu.0", "forward"), ("Functional.gelu.1", "forward")}
assert got == want, f"flagged {got}, expected {want}"
assert os.stat(glob.glob(os.path.join(out, "api_precision_compare_result_*_rank0.csv"))[0]).st_uid == 10001
html = glob.glob(os.path.join(out, "report_*.html"))
assert html and "Functional.gelu" in open(html[0], encoding="utf-8").read(), "no HTML report naming the failure"
print(f"[docker/test.sh] reports OK: {sorted(got)} flagged, files owned by uid 10001, {os.path.basename(html[0])}")
PY
# -- mutual TLS: certificates from certs/make_certs.py, the HEALTHCHECK with a client certificate ----------------
say "mutual TLS: certificates from certs/make_certs.py, server container with tls_path, HEALTHCHECK over TLS"
"$PY" certs/make_certs.py --out "$WORK/certs" --server-name localhost --server-name 127.0.0.1 --client training \
  --client health >/dev/null || die "certs/make_certs.py failed"
chown -R 10001:10001 "$WORK/certs"
mkdir -p "$WORK/out-tls" && chown 10001:10001 "$WORK/out-tls"
PORT2=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
sed -e "s/\"port\": $PORT/\"port\": $PORT2/" -e 's|"tls_path": ""|"tls_path": "/certs/server"|' \
  "$WORK/config/server.json" >"$WORK/config/server-tls.json"
sed -e "s/\"port\": $PORT/\"port\": $PORT2/" -e "s|\"tls_path\": \"\"|\"tls_path\": \"$WORK/certs/clients/training\"|" \
  "$WORK/agent.json" >"$WORK/agent-tls.json"
docker run -d --name "$NAME-tls" --network host -e OMP_NUM_THREADS=1 -e GPU_SERVER_HEALTH_PORT="$PORT2" \
  -e GPU_SERVER_HEALTH_TLS=/certs/clients/health -e GPU_SERVER_HEALTH_NAME=localhost \
  --health-interval 2s --health-start-period 60s \
  -v "$WORK/config:/config:ro" -v "$WORK/certs:/certs:ro" -v "$WORK/out-tls:/out" "$IMAGE" \
  --config /config/server-tls.json --out /out >/dev/null
for _ in $(seq 120); do
  STATE=$(docker inspect -f '{{.State.Health.Status}} {{.State.Running}}' "$NAME-tls")
  case "$STATE" in healthy*) break ;; *false) die "the TLS container exited: $(docker logs "$NAME-tls" 2>&1 | tail -30)" ;; esac
  sleep 1
done
[ "${STATE%% *}" = healthy ] || die "the TLS health check never passed: $(docker inspect -f '{{json .State.Health}}' "$NAME-tls")"
PYTHONPATH="$ROOT" "$PY" -m gpu_server.cli health --host 127.0.0.1 --port "$PORT2" --server-name localhost \
  --tls-path "$WORK/certs/clients/health" | grep -q SERVING || die "the host's probe with a client certificate failed"
if PYTHONPATH="$ROOT" "$PY" -m gpu_server.cli health --host 127.0.0.1 --port "$PORT2" --timeout 3 >/dev/null 2>&1; then
  die "a plaintext probe was answered by the TLS server"
fi
say "TLS HEALTHCHECK healthy; a probe without a client certificate is refused"
OMP_NUM_THREADS=1 RANK=0 PYTHONPATH="$ROOT" "$PY" -c "from tests.faulty_kernels import main; main()" \
  --config "$WORK/agent-tls.json" --model convnet --dtype float32 --steps 1 || die "the training over TLS failed"
docker stop -t 300 "$NAME-tls" >/dev/null
CODE=$(docker inspect -f '{{.State.ExitCode}}' "$NAME-tls")
[ "$CODE" = 0 ] || die "the TLS server exited with $CODE: $(docker logs "$NAME-tls" 2>&1 | tail -30)"
"$PY" - "$WORK/out-tls" <<'PY'
import os, sys
sys.path.insert(0, os.getcwd())
from tests import support
rows = support.read_csv(sys.argv[1], "api_precision_compare_result", 0)
assert len(rows) > 5 and {r["Forward Test Success"] for r in rows} <= {"pass", "SKIP"}, rows
print(f"[docker/test.sh] TLS run OK: {len(rows)} calls checked over mutual TLS, none failed")
PY
say "passed in $(( $(date +%s) - T0 )) s"
