#!/usr/bin/env bash
# End to end on a kind cluster: gpud and gpud-k8s from deploy/kubernetes, and the examples' pods
# getting their GPUs and shares.
#
# NOT run in CI, nor by the test suite: it needs Docker (with its daemon running), kind, kubectl and
# the network (to pull the kind node image and the Python base image). No GPU is needed: gpud
# simulates two 80 GiB GPUs on the kind worker (GPUD_SIMULATE=2x80GiB), which gpud-k8s publishes as
# it would real ones.
#
#   deploy/kubernetes/kind-e2e.sh            # from anywhere; exits 0 when every check passed
#
# Environment:
#   KIND_NODE_IMAGE  the node image, Kubernetes 1.37 or later (default kindest/node:v1.37.0)
#   CLUSTER          the kind cluster's name (default gpud-e2e; one of that name must not exist)
#   KEEP=1           leave the cluster up at the end (its kubeconfig is printed)
#   SKIP_BUILD=1     do not build gpud:0.1.0, load the one Docker has
#
# What it does: makes a cluster (a control plane, one worker labelled gpud.io/gpu=true) with
# DRAConsumableCapacity and DRAExtendedResource on, builds the image (deploy/kubernetes/Dockerfile)
# and loads it, applies the namespace, RBAC, gpud's config, the ResourceSlice policy, the
# DeviceClass with its extended resource and the DaemonSet, waits for the worker's ResourceSlice,
# then runs the examples in three rounds and checks each pod's claim (the device, consumedCapacity,
# shareID), its environment and socket inside the pod, and gpud's allocation for it; after the
# first round, that deleting the pods frees their allocations in gpud. On failure it prints the cluster's state and the agent's logs.
# The cluster is deleted at the end, whatever the outcome, unless KEEP=1.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) ends the script too

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CLUSTER=${CLUSTER:-gpud-e2e}
NODE_IMAGE=${KIND_NODE_IMAGE:-kindest/node:v1.37.0}
KEEP=${KEEP:-0}
SKIP_BUILD=${SKIP_BUILD:-0}
IMAGE=gpud:0.1.0
NS=gpud-e2e
WORK=$(mktemp -d)
export KUBECONFIG="$WORK/kubeconfig"  # this cluster's only: the user's kubeconfig is left alone
CREATED=0
WORKER=""
GPUD_POD=""

log() { printf '\n== %s\n' "$*"; }
fail() {
    printf '\nFAIL: %s\n' "$*" >&2
    exit 1
}

diagnostics() {
    log "diagnostics"
    kubectl get nodes,pods -A -o wide || true
    kubectl get resourceslices -o yaml || true
    kubectl get resourceclaims -A -o yaml || true
    kubectl -n "$NS" describe pods || true
    kubectl -n gpud-system describe pods || true
    kubectl -n gpud-system logs daemonset/gpud -c gpud --tail=200 || true
    kubectl -n gpud-system logs daemonset/gpud -c gpud-k8s --tail=200 || true
}

cleanup() {
    local rc=$?
    if ((rc != 0 && CREATED)); then
        diagnostics
    fi
    if ((CREATED)) && [[ $KEEP == 1 ]]; then
        printf '\ncluster %s kept: export KUBECONFIG=%s\n' "$CLUSTER" "$KUBECONFIG"
    else
        if ((CREATED)); then
            kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
        fi
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT

# until_true SECONDS WHAT COMMAND...: run COMMAND every 2 s until it succeeds, or fail naming WHAT.
until_true() {
    local timeout=$1 what=$2
    shift 2
    local end=$((SECONDS + timeout))
    until "$@"; do
        ((SECONDS < end)) || fail "timed out after ${timeout}s waiting for $what"
        sleep 2
    done
}

for tool in docker kind kubectl; do
    command -v "$tool" >/dev/null 2>&1 || fail "$tool is not installed (this script needs docker, kind and kubectl)"
done
docker info >/dev/null 2>&1 || fail "docker cannot reach its daemon"
version=${NODE_IMAGE##*:v}
version=${version%%@*}
if [[ ! $version =~ ^([0-9]+)\.([0-9]+) ]] || ((BASH_REMATCH[1] == 1 && BASH_REMATCH[2] < 37)); then
    fail "$NODE_IMAGE: the examples need Kubernetes 1.37 or later (KIND_NODE_IMAGE=kindest/node:v1.37.x)"
fi
clusters=$(kind get clusters 2>/dev/null || true)
if [[ $'\n'$clusters$'\n' == *$'\n'$CLUSTER$'\n'* ]]; then
    fail "a kind cluster named $CLUSTER exists already (CLUSTER=another-name, or kind delete cluster --name $CLUSTER)"
fi

log "kind cluster $CLUSTER ($NODE_IMAGE)"
# DRAConsumableCapacity: devices shared by capacity (allowMultipleAllocations, capacity requests);
# DRAExtendedResource: a DeviceClass's extendedResourceName (GA in 1.37, where naming it on only
# warns). DRA itself (resource.k8s.io/v1) needs no gate, and kind's containerd (2.x) reads CDI specs
# from /var/run/cdi by default.
cat >"$WORK/kind.yaml" <<'EOF'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
featureGates:
  DRAConsumableCapacity: true
  DRAExtendedResource: true
nodes:
  - role: control-plane
  - role: worker
    labels:
      gpud.io/gpu: "true"
EOF
CREATED=1
kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --config "$WORK/kind.yaml" --kubeconfig "$KUBECONFIG" --wait 120s
WORKER=$(kubectl get nodes -l gpud.io/gpu=true -o jsonpath='{.items[0].metadata.name}')

if [[ $SKIP_BUILD != 1 ]]; then
    log "building $IMAGE"
    docker build -f "$HERE/Dockerfile" -t "$IMAGE" "$ROOT"
fi
kind load docker-image "$IMAGE" --name "$CLUSTER"

log "gpud and gpud-k8s"
kubectl apply -f "$HERE/namespace.yaml" -f "$HERE/rbac.yaml" -f "$HERE/gpud-config.yaml" \
    -f "$HERE/resourceslice-policy.yaml" -f "$HERE/deviceclass-extended-resource.yaml"
# The DaemonSet as shipped, with gpud told to simulate the worker's GPUs (kind has none).
kubectl patch --local -f "$HERE/daemonset.yaml" --type strategic -o yaml \
    -p '{"spec":{"template":{"spec":{"containers":[{"name":"gpud","env":[{"name":"GPUD_SIMULATE","value":"2x80GiB"}]}]}}}}' |
    kubectl apply -f -
kubectl -n gpud-system rollout status daemonset/gpud --timeout=300s
GPUD_POD=$(kubectl -n gpud-system get pods -l app.kubernetes.io/name=gpud --field-selector "spec.nodeName=$WORKER" \
    -o jsonpath='{.items[0].metadata.name}')

slice() { kubectl get resourceslices --field-selector "spec.driver=gpu.gpud.io,spec.nodeName=$WORKER" -o jsonpath="$1"; }
slice_has_two_shared_gpus() {
    [[ $(slice '{.items[*].spec.devices[*].name}') == "gpu-0 gpu-1" ]] &&
        [[ $(slice '{.items[*].spec.devices[*].allowMultipleAllocations}') == "true true" ]]
}
until_true 120 "the ResourceSlice of $WORKER with gpu-0 and gpu-1, shared by capacity" slice_has_two_shared_gpus
[[ $(slice '{.items[0].spec.pool.name}') == "$WORKER" ]] || fail "the slice's pool is not named after its node"
[[ $(kubectl get deviceclass gpu.gpud.io -o jsonpath='{.spec.extendedResourceName}') == gpud.io/gpu ]] ||
    fail "the DeviceClass gpu.gpud.io serves no extended resource gpud.io/gpu"

kubectl create namespace "$NS"

claim_field() { kubectl -n "$NS" get resourceclaim "$1" -o jsonpath="$2"; }
# has_allocation UID: 0 when gpud holds the allocation k8s-UID, 1 when it does not, 2 when gpuctl
# could not say (its output is read whole: grep -q in a pipe may cut the writer off, which pipefail
# would count as a failure).
has_allocation() {
    local out
    out=$(kubectl -n gpud-system exec "$GPUD_POD" -c gpud -- gpuctl allocs --json) || return 2
    [[ $out == *"k8s-$1"* ]]
}
no_allocation() {
    local rc=0
    has_allocation "$1" || rc=$?
    ((rc == 1))
}

# check_claim POD CLAIM CORES MEMORY: the claim's one result is a device of the worker's pool with
# that share and a shareID; the pod sees its own socket and task id; gpud holds the allocation.
# MEMORY "whole" is all of the device's memory as the slice publishes it. Prints the device.
check_claim() {
    local pod=$1 claim=$2 cores=$3 memory=$4
    local uid device pool got_cores got_memory share env
    uid=$(claim_field "$claim" '{.metadata.uid}')
    device=$(claim_field "$claim" '{.status.allocation.devices.results[0].device}')
    pool=$(claim_field "$claim" '{.status.allocation.devices.results[0].pool}')
    got_cores=$(claim_field "$claim" '{.status.allocation.devices.results[0].consumedCapacity.cores}')
    got_memory=$(claim_field "$claim" '{.status.allocation.devices.results[0].consumedCapacity.memory}')
    share=$(claim_field "$claim" '{.status.allocation.devices.results[0].shareID}')
    if [[ $memory == whole ]]; then
        memory=$(slice "{.items[0].spec.devices[?(@.name==\"$device\")].capacity.memory.value}")
    fi
    [[ $pool == "$WORKER" && $device =~ ^gpu-[01]$ ]] || fail "$pod: claim $claim got $pool/$device"
    [[ $got_cores == "$cores" ]] || fail "$pod: claim $claim consumed cores '$got_cores', not $cores"
    [[ $got_memory == "$memory" ]] || fail "$pod: claim $claim consumed memory '$got_memory', not $memory"
    [[ -n $share ]] || fail "$pod: claim $claim has no shareID"
    # shellcheck disable=SC2016 # expanded in the pod
    env=$(kubectl -n "$NS" exec "$pod" -- sh -c 'test -S /run/gpud/gpud.sock && echo "$GPUD_SOCKET $GPUD_TASK_ID"') ||
        fail "$pod: no socket at /run/gpud/gpud.sock"
    [[ $env == "/run/gpud/gpud.sock k8s-$uid" ]] || fail "$pod: GPUD_SOCKET and GPUD_TASK_ID are '$env'"
    kubectl -n "$NS" exec "$pod" -- gpuctl status >/dev/null || fail "$pod: gpuctl status through its socket failed"
    has_allocation "$uid" || fail "$pod: gpud holds no allocation k8s-$uid"
    printf '%s: %s %s cores=%s memory=%s\n' "$pod" "$claim" "$device" "$got_cores" "$got_memory" >&2
    echo "$device"
}
pod_claim() { kubectl -n "$NS" get pod "$1" -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}'; }

log "round 1: a whole GPU, a quarter (25 cores, 20Gi) and a best-effort half (50 cores, 8Gi)"
kubectl -n "$NS" apply -f "$HERE/examples/whole-gpu.yaml" -f "$HERE/examples/quarter-gpu-20gib.yaml" \
    -f "$HERE/examples/best-effort-suspend.yaml"
kubectl -n "$NS" wait --for=condition=Ready pod/whole-gpu pod/quarter-gpu-20gib pod/best-effort-suspend --timeout=180s
whole=$(check_claim whole-gpu "$(pod_claim whole-gpu)" 100 whole)
quarter=$(check_claim quarter-gpu-20gib "$(pod_claim quarter-gpu-20gib)" 25 20Gi)
half=$(check_claim best-effort-suspend "$(pod_claim best-effort-suspend)" 50 8Gi)
[[ $quarter != "$whole" && $half != "$whole" ]] || fail "a share was placed on the whole GPU $whole"
uids=$(kubectl -n "$NS" get resourceclaims -o jsonpath='{.items[*].metadata.uid}')
kubectl -n "$NS" delete -f "$HERE/examples/whole-gpu.yaml" -f "$HERE/examples/quarter-gpu-20gib.yaml" \
    -f "$HERE/examples/best-effort-suspend.yaml" --wait=true --timeout=120s
for uid in $uids; do
    until_true 60 "gpud to free k8s-$uid once its pod was deleted" no_allocation "$uid"
done

log "round 2: a whole GPU by the extended resource, three inference replicas on quarters, their PDB"
kubectl -n "$NS" apply -f "$HERE/examples/extended-resource.yaml" -f "$HERE/examples/inference-pdb.yaml"
kubectl -n "$NS" wait --for=condition=Ready pod/extended-resource --timeout=180s
kubectl -n "$NS" rollout status deployment/inference --timeout=180s
claim=$(kubectl -n "$NS" get pod extended-resource -o jsonpath='{.status.extendedResourceClaimStatus.resourceClaimName}')
[[ -n $claim ]] || fail "extended-resource: the scheduler made no claim for gpud.io/gpu"
whole=$(check_claim extended-resource "$claim" 100 whole)
for pod in $(kubectl -n "$NS" get pods -l app.kubernetes.io/name=inference -o jsonpath='{.items[*].metadata.name}'); do
    device=$(check_claim "$pod" "$(pod_claim "$pod")" 25 16Gi)
    [[ $device != "$whole" ]] || fail "$pod: a share was placed on the whole GPU $whole"
done
pdb_allows_one() { [[ $(kubectl -n "$NS" get pdb inference -o jsonpath='{.status.disruptionsAllowed}') == 1 ]]; }
until_true 60 "the PodDisruptionBudget to allow one disruption" pdb_allows_one
kubectl -n "$NS" delete -f "$HERE/examples/extended-resource.yaml" -f "$HERE/examples/inference-pdb.yaml" \
    --wait=true --timeout=120s

log "round 3: the device-plugin fallback (gpud.io/gpu-seat)"
seats() { kubectl get node "$WORKER" -o jsonpath='{.status.allocatable.gpud\.io/gpu-seat}'; }
has_seats() { [[ $(seats) =~ ^[1-9][0-9]*$ ]]; }
until_true 120 "$WORKER to advertise gpud.io/gpu-seat" has_seats
kubectl -n "$NS" apply -f "$HERE/examples/device-plugin-seat.yaml"
kubectl -n "$NS" wait --for=condition=Ready pod/device-plugin-seat --timeout=180s
# shellcheck disable=SC2016 # expanded in the pod
kubectl -n "$NS" exec device-plugin-seat -- sh -c 'test -S "${GPUD_SOCKET:-/run/gpud/gpud.sock}"' ||
    fail "device-plugin-seat: no gpud socket in the pod"
kubectl -n "$NS" exec device-plugin-seat -- gpuctl status >/dev/null || fail "device-plugin-seat: gpuctl status failed"
kubectl -n "$NS" delete -f "$HERE/examples/device-plugin-seat.yaml" --wait=true --timeout=120s

log "all checks passed"
