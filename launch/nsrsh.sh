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
fi
# every host's only interface is eth0: gloo (the DDP baseline) must use it, not the hostname
export GLOO_SOCKET_IFNAME=eth0
exec ip netns exec "$host" bash -c "$*"
