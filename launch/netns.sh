#!/usr/bin/env bash
# Two Linux network namespaces joined by a veth pair, optionally shaped with tc: a real network
# path (not loopback) between a "server host" and a "worker host" on one machine. Needs root.
#
#   launch/netns.sh up   NAME [RATE [DELAY]]   e.g. launch/netns.sh up ps 100mbit 1ms
#   launch/netns.sh down NAME
#
# Creates namespaces NAME-srv (10.213.N.1) and NAME-wrk (10.213.N.2), N from 1..250 (printed).
# RATE shapes both directions with a token bucket (tc tbf); DELAY adds one-way latency (netem).
# Then, for example:
#   ip netns exec NAME-srv psparse-server --bind 10.213.N.1 --port 5555 --workers 2 --out runs/x
#   ip netns exec NAME-wrk psparse-worker --rank 0 --workers 2 --connect 10.213.N.1:5555
set -euo pipefail
cmd=${1:?usage: netns.sh up|down NAME [RATE [DELAY]]}
name=${2:?usage: netns.sh up|down NAME [RATE [DELAY]]}
rate=${3:-}
delay=${4:-}
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
down)
    ip netns del "$srv" 2>/dev/null || true
    ip netns del "$wrk" 2>/dev/null || true
    ;;
*)
    echo "usage: netns.sh up|down NAME [RATE [DELAY]]" >&2
    exit 2
    ;;
esac
