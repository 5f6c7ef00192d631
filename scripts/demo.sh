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
# copies stamped with this environment's kernel metadata, so they open unmodified (copies already there are kept)
"$BIN/python" scripts/make_examples.py --copy-to "$NOTEBOOKS"

# Unix socket paths are limited to ~107 bytes
SOCK="$DEMO_DIR/broker.sock"
if [ ${#SOCK} -gt 100 ]; then SOCK="/tmp/gpulease-demo-$(id -u)/broker.sock"; mkdir -p "$(dirname "$SOCK")"; fi
export GPULEASE_BROKER="unix://$SOCK"
export GPULEASE_ARTIFACT_ROOT="$NOTEBOOKS/artifacts"   # inside the server's root: the sidebar opens them

# One Ctrl-C stops both, in order: JupyterLab first (its kernels release their leases), then the broker. The
# terminal's Ctrl-C reaches JupyterLab (our process group) and this script, never the broker (its own session);
# a SIGINT or SIGTERM to this script alone does the same.
BROKER_PID="" LAB_PID=""
stop() {  # stop PID NAME: SIGTERM, then wait for it (SIGKILL after 30 s)
    [ -n "$1" ] && kill -0 "$1" 2>/dev/null || return 0
    kill -TERM "$1" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$1" 2>/dev/null || { wait "$1" 2>/dev/null || true; return 0; }; sleep 0.1; done
    echo "$2 did not stop within 30 s: SIGKILL"; kill -KILL "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true
}
cleanup() {
    trap - INT TERM EXIT
    stop "$LAB_PID" JupyterLab
    stop "$BROKER_PID" "The broker"
    [ -n "$BROKER_PID" ] && echo "Stopped JupyterLab and the broker."
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

SETSID=()
command -v setsid >/dev/null && SETSID=(setsid)
echo "Starting the lease broker with $GPUS simulated GPUs on $NODES node(s): $GPULEASE_BROKER"
"${SETSID[@]}" "$BIN/lease-broker" --inventory=simulated --gpus="$GPUS" --nodes="$NODES" --socket="$SOCK" \
    --db="$DEMO_DIR/leases.db" >"$DEMO_DIR/broker.log" 2>&1 &
BROKER_PID=$!
for _ in $(seq 1 200); do
    "$BIN/gpulease" status >/dev/null 2>&1 && break
    kill -0 "$BROKER_PID" 2>/dev/null || { echo "The broker failed to start:"; cat "$DEMO_DIR/broker.log"; exit 1; }
    sleep 0.1
done
"$BIN/gpulease" status

# No "Jupyter news" toast in the demo, and the GPU panel open from the start
SETTINGS="$PWD/.venv/share/jupyter/lab/settings"
mkdir -p "$SETTINGS"
[ -e "$SETTINGS/overrides.json" ] || cat >"$SETTINGS/overrides.json" <<'JSON'
{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false},
 "jupyter-gpulease:plugin": {"openAtStart": true}}
JSON

# The GPU panel open at the first start: a workspace of the demo's own with it current in the left sidebar (kept
# once JupyterLab saves the user's own layout there)
WORKSPACES="$DEMO_DIR/workspaces"
"$BIN/python" - "$WORKSPACES" <<'PY'
import json, sys
from pathlib import Path
from jupyterlab_server.workspaces_handler import WorkspacesManager
manager = WorkspacesManager(Path(sys.argv[1]))
if not list(Path(sys.argv[1]).glob("*.jupyterlab-workspace")):
    left = {"collapsed": False, "visible": True, "current": "gpulease-panel", "widgets": ["gpulease-panel"]}
    manager.save("default", json.dumps({"data": {"layout-restorer:data": {"left": left}},
                                        "metadata": {"id": "default"}}))
PY

TOKEN=${DEMO_TOKEN:-$("$BIN/python" -c 'import secrets; print(secrets.token_hex(16))')}
ROOT_FLAG=()
[ "$(id -u)" = 0 ] && ROOT_FLAG=(--allow-root)
# --ServerApp.answer_yes: a Ctrl-C stops JupyterLab at once (no "Shut down this Jupyter server (y/[n])?")
LAB=("$BIN/jupyter" lab --no-browser --ip="$IP" --port="$PORT" --IdentityProvider.token="$TOKEN"
     --ServerApp.root_dir="$NOTEBOOKS" --LabApp.workspaces_dir="$WORKSPACES" --ServerApp.port_retries=0 --ServerApp.answer_yes=True "${ROOT_FLAG[@]}")
URL="http://$IP:$PORT/lab/tree/quickstart.ipynb?token=$TOKEN"

fetch() {  # fetch URL -> body on stdout; fails on HTTP errors (no curl needed)
    "$BIN/python" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

echo
echo "For the gpulease CLI in a second terminal:"
echo "  source $BIN/activate"
echo "  export GPULEASE_BROKER=$GPULEASE_BROKER"

if [ "${DEMO_CHECK:-0}" = 1 ]; then
    "${LAB[@]}" >"$DEMO_DIR/lab.log" 2>&1 &
    LAB_PID=$!
    for _ in $(seq 1 300); do
        if fetch "http://$IP:$PORT/api/status?token=$TOKEN" >/dev/null 2>&1; then
            echo "JupyterLab answers at http://$IP:$PORT/lab"
            fetch "http://$IP:$PORT/lab/api/extensions?token=$TOKEN" | grep -q '"jupyter-gpulease"' \
                && echo "sidebar extension: enabled" || echo "sidebar extension: NOT FOUND"
            fetch "http://$IP:$PORT/gpulease/api/gpus?token=$TOKEN" >/dev/null 2>&1 \
                && echo "server extension: answers" || echo "server extension: NOT ANSWERING"
            exit 0
        fi
        kill -0 "$LAB_PID" 2>/dev/null || { echo "JupyterLab failed to start:"; tail -30 "$DEMO_DIR/lab.log"; exit 1; }
        sleep 0.2
    done
    echo "JupyterLab did not answer within 60 s"; tail -30 "$DEMO_DIR/lab.log"; exit 1
fi

echo
echo "Open $URL"
echo "(the GPU panel is in the left sidebar; Ctrl-C stops JupyterLab and the broker)"
"${LAB[@]}" </dev/null &
LAB_PID=$!
wait "$LAB_PID" || true  # returns at once on a signal: the trap then stops both
LAB_PID=""
