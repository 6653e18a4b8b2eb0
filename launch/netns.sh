#!/usr/bin/env bash
# Two Linux network namespaces joined by a veth pair, optionally shaped with tc: a real network
# path (not loopback) between a "server host" and a "worker host" on one machine. Needs root.
#
#   launch/netns.sh up      NAME [RATE [DELAY]]   e.g. launch/netns.sh up ps 100mbit 1ms
#   launch/netns.sh cluster NAME HOSTS RATE [DELAY] e.g. launch/netns.sh cluster pc 9 25mbit
#   launch/netns.sh down    NAME
#
# `cluster` makes a rack: HOSTS namespaces NAME-h0 .. NAME-h<HOSTS-1> (h0: the server's host),
# each with one interface eth0 (10.214.N.<i+1>/24) joined by its own veth pair to a bridge in a
# switch namespace NAME-sw; each host's link is shaped in both directions with tc tbf at RATE
# (its eth0 for what it sends, its switch port for what it receives), plus netem DELAY where the
# kernel has netem (else a clear refusal). Each host also gets a CPU share: a cgroup (v1 cpu)
# psparse-NAME-h<i> with a CFS quota of CPUS / HOSTS cores (CPUS: $PSNET_CPUS, may be a fraction
# like 1.5, default all of this machine's), so that emulated hosts compute side by side as on separate machines, not one
# after another; and each host is pinned to one CPU (cgroup v1 cpuset psparse-NAME-h<i>, CPU
# i modulo this machine's CPUs), as a host's share of one core: a quota smaller than the
# kernel's bandwidth slice (sched_cfs_bandwidth_slice_us, 5 ms) cannot be split between a
# host's threads on two CPUs without stalls, which a real host does not have
# (PSNET_PIN=0: no pinning). launch/nsrsh.sh HOST 'COMMAND' runs a command on a host (its
# namespace and its cgroups): the --rsh of psparse-launch --hostfile. Prints the hosts' addresses, h0 first.
#
# Creates namespaces NAME-srv (10.213.N.1) and NAME-wrk (10.213.N.2), N from 1..250 (printed).
# RATE shapes both directions with a token bucket (tc tbf); DELAY adds one-way latency (netem).
# Then, for example:
#   ip netns exec NAME-srv psparse-server --bind 10.213.N.1 --port 5555 --workers 2 --out runs/x
#   ip netns exec NAME-wrk psparse-worker --rank 0 --workers 2 --connect 10.213.N.1:5555
set -euo pipefail
usage="usage: netns.sh up NAME [RATE [DELAY]] | cluster NAME HOSTS RATE [DELAY] | down NAME"
cmd=${1:?$usage}
name=${2:?$usage}
if [ "$cmd" = cluster ]; then
    hosts=${3:?$usage}
    rate=${4:?$usage}
    delay=${5:-}
else
    rate=${3:-}
    delay=${4:-}
fi
srv=${name}-srv
wrk=${name}-wrk
# interface names are limited to 15 characters
veth_a="v${name:0:10}a"
veth_b="v${name:0:10}b"

case "$cmd" in
up)
    # a half-made setup is removed again, so a failed `up` leaves nothing behind
    trap 'ip netns del "$srv" 2>/dev/null; ip netns del "$wrk" 2>/dev/null' ERR
    net=$(( $(printf '%s' "$name" | cksum | cut -d' ' -f1) % 250 + 1 ))
    ip netns add "$srv"
    ip netns add "$wrk"
    ip link add "$veth_a" type veth peer name "$veth_b"
    ip link set "$veth_a" netns "$srv"
    ip link set "$veth_b" netns "$wrk"
    ip -n "$srv" addr add "10.213.$net.1/24" dev "$veth_a"
    ip -n "$wrk" addr add "10.213.$net.2/24" dev "$veth_b"
    for ns in "$srv" "$wrk"; do ip -n "$ns" link set lo up; done
    ip -n "$srv" link set "$veth_a" up
    ip -n "$wrk" link set "$veth_b" up
    if [ -n "$rate" ]; then
        for pair in "$srv:$veth_a" "$wrk:$veth_b"; do
            ns=${pair%%:*}
            dev=${pair#*:}
            if [ -n "$delay" ]; then
                if ! tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$delay"; then
                    echo "netem is not available in this kernel: omit DELAY" >&2
                    false
                fi
                tc -n "$ns" qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" \
                    burst 64kb latency 100ms
            else
                tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst 64kb latency 100ms
            fi
        done
    fi
    echo "10.213.$net.1 10.213.$net.2"
    ;;
cluster)
    case "$hosts" in ''|*[!0-9]*) echo "HOSTS must be a number, got '$hosts'" >&2; exit 2;; esac
    [ "$hosts" -ge 2 ] && [ "$hosts" -le 200 ] || { echo "HOSTS must be 2..200" >&2; exit 2; }
    if [ -n "$delay" ] && ! modinfo sch_netem >/dev/null 2>&1 \
            && ! grep -qw sch_netem /proc/modules 2>/dev/null; then
        echo "netem is not available in this kernel: DELAY '$delay' cannot be emulated (omit it)" >&2
        exit 3
    fi
    cpus=${PSNET_CPUS:-$(nproc)}
    period=10000  # 10 ms: a short period, so a throttled host waits ms, not 100s of ms
    quota=$(awk -v c="$cpus" -v p="$period" -v h="$hosts" \
        'BEGIN { q = int(c * p / h); if (c !~ /^[0-9]*\.?[0-9]+$/ || q < 1000) exit 1; print q }') \
        || { echo "PSNET_CPUS must be a number of cores giving each host >= 0.1 core, got '$cpus'" >&2; exit 2; }
    trap '"$0" down "$name"' ERR
    net=$(( $(printf '%s' "$name" | cksum | cut -d' ' -f1) % 250 + 1 ))
    sw=${name}-sw
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    addrs=""
    for i in $(seq 0 $((hosts - 1))); do
        ns=${name}-h$i
        ip netns add "$ns"
        ip link add eth0 netns "$ns" type veth peer name "p$i" netns "$sw"
        ip -n "$ns" addr add "10.214.$net.$((i + 1))/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        ip -n "$sw" link set "p$i" master br0
        ip -n "$sw" link set "p$i" up
        for pair in "$ns:eth0" "$sw:p$i"; do
            dns=${pair%%:*}
            dev=${pair#*:}
            if [ -n "$delay" ]; then
                tc -n "$dns" qdisc add dev "$dev" root handle 1: netem delay "$delay"
                tc -n "$dns" qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" \
                    burst 32kb latency 200ms
            else
                tc -n "$dns" qdisc add dev "$dev" root tbf rate "$rate" burst 32kb latency 200ms
            fi
        done
        cg=/sys/fs/cgroup/cpu/psparse-$ns
        if [ -d /sys/fs/cgroup/cpu ]; then
            mkdir -p "$cg"
            echo "$period" > "$cg/cpu.cfs_period_us"
            echo "$quota" > "$cg/cpu.cfs_quota_us"
        fi
        cs=/sys/fs/cgroup/cpuset/psparse-$ns
        if [ "${PSNET_PIN:-1}" = 1 ] && [ -d /sys/fs/cgroup/cpuset ]; then
            mkdir -p "$cs"
            echo $(( i % $(nproc) )) > "$cs/cpuset.cpus"
            cat /sys/fs/cgroup/cpuset/cpuset.mems > "$cs/cpuset.mems"
        fi
        addrs="$addrs 10.214.$net.$((i + 1))"
    done
    echo "${addrs# }"
    ;;
down)
    ip netns del "$srv" 2>/dev/null || true
    ip netns del "$wrk" 2>/dev/null || true
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^${name}-(h[0-9]+|sw)\$" || true); do
        ip netns del "$ns" 2>/dev/null || true
        for cg in /sys/fs/cgroup/cpu/psparse-$ns /sys/fs/cgroup/cpuset/psparse-$ns; do
            [ -d "$cg" ] && rmdir "$cg" 2>/dev/null || true
        done
    done
    ;;
*)
    echo "$usage" >&2
    exit 2
    ;;
esac
