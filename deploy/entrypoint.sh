#!/usr/bin/env bash
# Entry point of the bnrecal image (deploy/Dockerfile), run under tini.
#
#   api [serve flags]     join the Ray cluster at RAY_ADDRESS as a zero-resource node, then run
#                         `bnrecal serve` as a full Ray driver on it (placement groups, actor
#                         streaming, ray.util.collective; no Ray Client). Without RAY_ADDRESS:
#                         serve with an embedded single-node Ray instance.
#   head [ray flags]      a Ray head node outside Kubernetes (no CPUs: ranks go to workers).
#   worker [ray flags]    a Ray worker node joining RAY_ADDRESS, outside Kubernetes.
#   healthcheck           the image's HEALTHCHECK: the API's /healthz, else the local raylet.
#   bnrecal ... | CMD ... run that command (e.g. `bnrecal calibrate ...`, `ray status`, `bash`).
#
# Under KubeRay this script is not used by the Ray pods: the operator runs `ray start` itself
# through `bash -lc`, which finds `ray` on the PATH of this same image.
#
# Environment: RAY_ADDRESS (host:port of the head's GCS), API_PORT (default 8000), POD_IP
# (this pod's IP, for the Ray node), WAIT_FOR_HEAD_S (default 600), ENTRYPOINT_DRY_RUN=1
# (print the commands instead of running them). bnrecal's own settings: BNRECAL_*.
# Ray token authentication: head, worker and api joining a cluster require RAY_AUTH_TOKEN
# (or RAY_AUTH_TOKEN_PATH), the one token of the whole cluster, and run with
# RAY_AUTH_MODE=token: an unauthenticated Ray port is remote code execution for anyone
# who reaches it. The embedded instance of `api` without RAY_ADDRESS makes its own token.
set -euo pipefail

readonly API_PORT="${API_PORT:-8000}"
readonly WAIT_FOR_HEAD_S="${WAIT_FOR_HEAD_S:-600}"
readonly DRY_RUN="${ENTRYPOINT_DRY_RUN:-}"
readonly MODE_FILE="${TMPDIR:-/tmp}/bnrecal-entrypoint.mode"

log() { printf 'bnrecal-entrypoint: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

# Run a command, or print it (shell-quoted, one line) in a dry run.
run() {
    if [[ -n "$DRY_RUN" ]]; then
        local quoted
        printf -v quoted '%q ' "$@"
        printf '%s\n' "${quoted% }"
        return 0
    fi
    "$@"
}

# Replace this shell with a command, or print it in a dry run.
run_exec() {
    if [[ -n "$DRY_RUN" ]]; then
        run "$@"
        exit 0
    fi
    exec "$@"
}

# Ray nodes and drivers of a cluster run with token authentication, never without.
require_ray_token() {
    if [[ -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
        die "$1 needs the cluster's Ray token: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH), the same on every node and the API (deploy/README.md, 'Ray is never open')"
    fi
    export RAY_AUTH_MODE=token
}

# Wait until the head's GCS answers, so a pod started before the head does not crash-loop.
wait_for_head() {
    local address="$1" waited=0
    if [[ -n "$DRY_RUN" ]]; then
        run ray health-check --address "$address"
        return 0
    fi
    until ray health-check --address "$address" >/dev/null 2>&1; do
        if (( waited >= WAIT_FOR_HEAD_S )); then
            die "the Ray head at $address did not answer within ${WAIT_FOR_HEAD_S}s (WAIT_FOR_HEAD_S); check RAY_ADDRESS and the RayCluster"
        fi
        log "waiting for the Ray head at $address (${waited}s)"
        sleep 5
        waited=$(( waited + 5 ))
    done
}

serve_api() {
    local serve=(bnrecal serve --host 0.0.0.0 --port "$API_PORT")
    local address="${RAY_ADDRESS:-}"
    [[ -n "$DRY_RUN" ]] || echo api > "$MODE_FILE"
    case "$address" in
        "")
            log "RAY_ADDRESS is not set: serving with an embedded single-node Ray instance"
            run_exec "${serve[@]}" "$@"
            ;;
        ray://*)
            die "RAY_ADDRESS=$address is a Ray Client address; the API must be a full driver: set RAY_ADDRESS to the head's GCS address host:6379"
            ;;
        auto)
            # A Ray node was already started in this container: drive it.
            run_exec "${serve[@]}" --ray-address auto "$@"
            ;;
    esac

    require_ray_token "api mode with RAY_ADDRESS"
    wait_for_head "$address"
    local node=(ray start --address="$address" --num-cpus=0 --num-gpus=0)
    if [[ -n "${POD_IP:-}" ]]; then
        node+=(--node-ip-address="$POD_IP")
    fi
    run "${node[@]}"
    if [[ -n "$DRY_RUN" ]]; then
        run "${serve[@]}" --ray-address auto "$@"
        run ray stop --grace-period 10
        exit 0
    fi

    # The server runs as a child so that, once it has shut down (running jobs back to the
    # queue), this node leaves the cluster cleanly.
    local child status=0
    "${serve[@]}" --ray-address auto "$@" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
    while true; do
        wait "$child" && status=0 || status=$?
        kill -0 "$child" 2>/dev/null || break  # a trapped signal interrupted wait: wait again
    done
    trap - TERM INT
    log "bnrecal serve exited with status $status; leaving the Ray cluster"
    ray stop --grace-period 10 >/dev/null 2>&1 || true
    exit "$status"
}

healthcheck() {
    if [[ "$(cat "$MODE_FILE" 2>/dev/null)" == api ]]; then
        wget -q -T 4 -O /dev/null "http://127.0.0.1:${API_PORT}/healthz"
    else
        # A Ray node: the dashboard agent's raylet check, as KubeRay's own probes do.
        wget -q -T 4 -O - "http://127.0.0.1:52365/api/local_raylet_healthz" | grep -q success
    fi
}

main() {
    local mode="${1:-api}"
    if (( $# > 0 )); then shift; fi
    case "$mode" in
        api)
            serve_api "$@"
            ;;
        head)
            require_ray_token "head mode"
            run_exec ray start --head --block --port=6379 --dashboard-host=0.0.0.0 --num-cpus=0 --num-gpus=0 "$@"
            ;;
        worker)
            [[ -n "${RAY_ADDRESS:-}" ]] || die "worker mode needs RAY_ADDRESS (the head's host:6379)"
            require_ray_token "worker mode"
            wait_for_head "$RAY_ADDRESS"
            run_exec ray start --address="$RAY_ADDRESS" --block "$@"
            ;;
        healthcheck)
            healthcheck
            ;;
        help|-h|--help)
            sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
            ;;
        *)
            run_exec "$mode" "$@"
            ;;
    esac
}

main "$@"
