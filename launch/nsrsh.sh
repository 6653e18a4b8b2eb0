#!/usr/bin/env bash
# A remote shell into an emulated host of `launch/netns.sh cluster`: runs COMMAND in the
# network namespace HOST and in the host's CPU share (cgroup psparse-HOST, when it exists), as
# ssh would run it on a separate machine. For psparse-launch --hostfile: --rsh launch/nsrsh.sh
#
#   launch/nsrsh.sh HOST 'COMMAND LINE'
set -euo pipefail
host=${1:?usage: nsrsh.sh HOST COMMAND...}
shift
cg=/sys/fs/cgroup/cpu/psparse-$host
if [ -d "$cg" ]; then
    echo $$ > "$cg/cgroup.procs"  # this shell and everything it starts
elif [ ! -d /sys/fs/cgroup/cpu ]; then
    # Called from inside another emulated host (the launcher runs in h0): `ip netns exec`
    # remounted /sys there, so the cgroup tree is not visible and the worker would silently stay
    # in the caller's CPU share (all 8 workers and the server on one host's 2/9 core). Mount
    # the cpu hierarchy privately, move this shell into the host's share, unmount.
    mnt=$(mktemp -d)
    if mount -t cgroup -o cpu psparse-cpu "$mnt" 2>/dev/null; then
        if [ -d "$mnt/psparse-$host" ]; then
            echo $$ > "$mnt/psparse-$host/cgroup.procs"
        fi
        umount "$mnt"
    fi
    rmdir "$mnt"
fi
# every host's only interface is eth0: gloo (the DDP baseline) must use it, not the hostname
export GLOO_SOCKET_IFNAME=eth0
exec ip netns exec "$host" bash -c "$*"
