#!/usr/bin/env bash
# `make demo`: a broker with a simulated GPU inventory + JupyterLab with the extension and the example notebooks.
#   DEMO_GPUS (4)  DEMO_NODES (1)  DEMO_PORT (8888)  DEMO_IP (127.0.0.1)
#   DEMO_CHECK=1   start everything, check that it answers, stop (used by the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO_DIR=$(mkdir -p "${1:-.demo}" && cd "${1:-.demo}" && pwd)
BIN=$PWD/.venv/bin
GPUS=${DEMO_GPUS:-4}
NODES=${DEMO_NODES:-1}
PORT=${DEMO_PORT:-8888}
IP=${DEMO_IP:-127.0.0.1}
NOTEBOOKS="$DEMO_DIR/notebooks"
mkdir -p "$NOTEBOOKS"
for nb in examples/*.ipynb; do
    [ -e "$NOTEBOOKS/$(basename "$nb")" ] || cp "$nb" "$NOTEBOOKS/"
done

# Unix socket paths are limited to ~107 bytes
SOCK="$DEMO_DIR/broker.sock"
if [ ${#SOCK} -gt 100 ]; then SOCK="/tmp/gpulease-demo-$(id -u)/broker.sock"; mkdir -p "$(dirname "$SOCK")"; fi
export GPULEASE_BROKER="unix://$SOCK"
export GPULEASE_ARTIFACT_ROOT="$NOTEBOOKS/artifacts"   # inside the server's root: the sidebar opens them

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

echo "Starting the lease broker with $GPUS simulated GPUs on $NODES node(s): $GPULEASE_BROKER"
"$BIN/lease-broker" --inventory=simulated --gpus="$GPUS" --nodes="$NODES" --socket="$SOCK" \
    --db="$DEMO_DIR/leases.db" >"$DEMO_DIR/broker.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 200); do
    "$BIN/gpulease" status >/dev/null 2>&1 && break
    kill -0 "${pids[0]}" 2>/dev/null || { echo "The broker failed to start:"; cat "$DEMO_DIR/broker.log"; exit 1; }
    sleep 0.1
done
"$BIN/gpulease" status

# No "Jupyter news" toast in the demo
SETTINGS="$PWD/.venv/share/jupyter/lab/settings"
mkdir -p "$SETTINGS"
[ -e "$SETTINGS/overrides.json" ] || cat >"$SETTINGS/overrides.json" <<'JSON'
{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}
JSON

TOKEN=${DEMO_TOKEN:-$("$BIN/python" -c 'import secrets; print(secrets.token_hex(16))')}
ROOT_FLAG=()
[ "$(id -u)" = 0 ] && ROOT_FLAG=(--allow-root)
LAB=("$BIN/jupyter" lab --no-browser --ip="$IP" --port="$PORT" --ServerApp.token="$TOKEN"
     --ServerApp.root_dir="$NOTEBOOKS" --ServerApp.port_retries=0 "${ROOT_FLAG[@]}")
URL="http://$IP:$PORT/lab/tree/quickstart.ipynb?token=$TOKEN"

fetch() {  # fetch URL -> body on stdout; fails on HTTP errors (no curl needed)
    "$BIN/python" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

if [ "${DEMO_CHECK:-0}" = 1 ]; then
    "${LAB[@]}" >"$DEMO_DIR/lab.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 300); do
        if fetch "http://$IP:$PORT/api/status?token=$TOKEN" >/dev/null 2>&1; then
            echo "JupyterLab answers at http://$IP:$PORT/lab"
            fetch "http://$IP:$PORT/lab/api/extensions?token=$TOKEN" | grep -q '"jupyter-gpulease"' \
                && echo "sidebar extension: enabled" || echo "sidebar extension: NOT FOUND"
            fetch "http://$IP:$PORT/gpulease/api/gpus?token=$TOKEN" >/dev/null 2>&1 \
                && echo "server extension: answers" || echo "server extension: NOT ANSWERING"
            exit 0
        fi
        kill -0 "${pids[1]}" 2>/dev/null || { echo "JupyterLab failed to start:"; tail -30 "$DEMO_DIR/lab.log"; exit 1; }
        sleep 0.2
    done
    echo "JupyterLab did not answer within 60 s"; tail -30 "$DEMO_DIR/lab.log"; exit 1
fi

echo
echo "Open $URL"
echo "(the GPU panel is in the left sidebar; Ctrl-C stops JupyterLab and the broker)"
"${LAB[@]}"
