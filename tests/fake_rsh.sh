#!/usr/bin/env bash
# Stands in for ssh in the tests: logs "host<TAB>command" and runs the command in a real local
# shell, as sshd would on the remote host. A host named deadhost fails like an unreachable one.
host=$1
shift
printf '%s\t%s\n' "$host" "$*" >> "${FAKE_RSH_LOG:-/dev/null}"
if [ "$host" = deadhost ]; then
    echo "ssh: connect to host deadhost port 22: No route to host" >&2
    exit 255
fi
exec bash -c "$*"
