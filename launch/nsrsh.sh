#!/usr/bin/env bash
# A remote shell into an emulated host of `launch/netns.sh cluster`: runs COMMAND in the
# network namespace HOST and in the host's CPU share and CPU (cgroups psparse-HOST, when they
# exist), as
# ssh would run it on a separate machine. For psparse-launch --hostfile: --rsh launch/nsrsh.sh
#
#   launch/nsrsh.sh HOST 'COMMAND LINE'
#
# HOST is a namespace's name, or an IPv4 address one of them holds: --server-hosts names each
# shard's host by the address the workers connect to, as a real cluster's host name serves both.
set -euo pipefail
host=${1:?usage: nsrsh.sh HOST COMMAND...}
shift
if [[ $host =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    for ns in $(ip netns list | awk '{print $1}'); do
        if ip -n "$ns" -4 -o addr show | grep -q " inet $host/"; then
            host=$ns
            break
        fi
    done
fi
# join the host's cgroups in each hierarchy (cpu: its CPU share; cpuset: its CPU, when pinned)
for ctl in cpu cpuset; do
    if [ -d /sys/fs/cgroup/$ctl ]; then
        if [ -d /sys/fs/cgroup/$ctl/psparse-$host ]; then
            echo $$ > /sys/fs/cgroup/$ctl/psparse-$host/cgroup.procs  # this shell and its children
        fi
    else
        # Called from inside another emulated host (the launcher runs in h0): `ip netns exec`
        # remounted /sys there, so the cgroup tree is not visible and the worker would silently
        # stay in the caller's share (all 8 workers and the server on one host's share). Mount
        # the hierarchy privately, move this shell into the host's cgroup, unmount.
        mnt=$(mktemp -d)
        if mount -t cgroup -o $ctl psparse-$ctl "$mnt" 2>/dev/null; then
            if [ -d "$mnt/psparse-$host" ]; then
                echo $$ > "$mnt/psparse-$host/cgroup.procs"
            fi
            umount "$mnt"
        fi
        rmdir "$mnt"
    fi
done
# every host's only interface is eth0: gloo (the DDP baseline) must use it, not the hostname
export GLOO_SOCKET_IFNAME=eth0
exec ip netns exec "$host" bash -c "$*"
