#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, each node on its own loopback address (the head on
# 127.0.0.2, the others on 127.0.0.3, ...): the one-machine twin of the multi-node recipe of
# docs/cluster.md, run by tests/e2e/test_multinode.py.
#
#   scripts/local_cluster.sh start DIR [NODES=2] [GPUS_PER_NODE=0]
#       starts the nodes with their files under DIR (keep DIR short: Ray's socket paths are
#       limited), Ray's token authentication on with a new token in DIR/token, and prints what
#       to export before `ray job submit` (RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH).
#       GPUS_PER_NODE > 0 declares that many GPUs per node to Ray (on a machine without CUDA
#       slime then places one bundle per "GPU", as on a GPU cluster, and computes on the CPU).
#   scripts/local_cluster.sh stop DIR
#       stops exactly the processes of that cluster (`ray stop` would stop every Ray of this user).
#
# Only 127.0.0.0/8 addresses are used: the whole block is loopback on Linux.
set -euo pipefail

cmd=${1:?usage: $0 start|stop DIR [NODES] [GPUS_PER_NODE]}
dir=${2:?usage: $0 start|stop DIR [NODES] [GPUS_PER_NODE]}
nodes=${3:-2}
gpus=${4:-0}
python=${PYTHON:-python}

free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ports Ray would otherwise take from fixed defaults (a second Ray on this machine would collide)
node_ports() {
    local flags=""
    for flag in --dashboard-agent-listen-port --dashboard-agent-grpc-port --metrics-export-port \
                --runtime-env-agent-port --node-manager-port --object-manager-port; do
        flags="$flags $flag $(free_port)"
    done
    echo "$flags"
}

case "$cmd" in
start)
    mkdir -p "$dir"
    unset RAY_ADDRESS RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER  # a real cluster: Ray's multi-node default
    "$python" -c 'import secrets; print(secrets.token_hex(32))' > "$dir/token"
    chmod 600 "$dir/token"
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$dir/token"
    gcs_port=$(free_port)
    dashboard_port=$(free_port)
    # shellcheck disable=SC2046
    ray start --head --node-ip-address 127.0.0.2 --port "$gcs_port" --num-cpus 2 --num-gpus "$gpus" \
        --include-dashboard true --dashboard-host 127.0.0.2 --dashboard-port "$dashboard_port" \
        --ray-client-server-port "$(free_port)" --temp-dir "$dir/ray" --disable-usage-stats \
        $(node_ports) > "$dir/head.log" 2>&1 || { cat "$dir/head.log" >&2; exit 1; }
    for ((i = 1; i < nodes; i++)); do
        # shellcheck disable=SC2046
        ray start --address "127.0.0.2:$gcs_port" --node-ip-address "127.0.0.$((i + 2))" --num-cpus 2 \
            --num-gpus "$gpus" --temp-dir "$dir/ray" --disable-usage-stats \
            $(node_ports) > "$dir/node$i.log" 2>&1 || { cat "$dir/node$i.log" >&2; exit 1; }
    done
    echo "export RAY_ADDRESS=http://127.0.0.2:$dashboard_port RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$dir/token"
    ;;
stop)
    "$python" - "$dir" <<'EOF'
import sys, psutil
marker = sys.argv[1].rstrip("/") + "/ray"
roots = []
for p in psutil.process_iter(["cmdline"]):
    try:
        if any(marker in part for part in (p.info["cmdline"] or [])):
            roots.append(p)
    except psutil.Error:
        pass
procs = {p.pid: p for p in roots}
for p in roots:
    try:
        procs.update({c.pid: c for c in p.children(recursive=True)})
    except psutil.Error:
        pass
for p in procs.values():
    try:
        p.terminate()
    except psutil.Error:
        pass
_, alive = psutil.wait_procs(list(procs.values()), timeout=5)
for p in alive:
    try:
        p.kill()
    except psutil.Error:
        pass
psutil.wait_procs(alive, timeout=10)
EOF
    ;;
*)
    echo "usage: $0 start|stop DIR [NODES] [GPUS_PER_NODE]" >&2
    exit 2
    ;;
esac
