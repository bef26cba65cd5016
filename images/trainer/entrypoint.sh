#!/usr/bin/env bash
# Entrypoint of the trainer image for MPIJob pods.
#
# Workers run the default command (sshd in the foreground). The launcher runs whatever the MPIJob
# passes as args, e.g. `mpirun ... python -m nightshift.train ...` or `horovodrun ...`; before that it
# waits until every worker in the operator's hostfile resolves in DNS, because a headless-service
# record can lag a pod becoming ready and mpirun gives up on the first unknown host.
set -euo pipefail

hostfile=${NIGHTSHIFT_MPI_HOSTFILE:-/etc/mpi/hostfile}
timeout_s=${NIGHTSHIFT_DNS_TIMEOUT:-120}

wait_for_host() {
    local host=$1 waited=0 delay=1
    until getent hosts "$host" >/dev/null; do
        if (( waited >= timeout_s )); then
            echo "nightshift-entrypoint: $host does not resolve after ${timeout_s}s; starting anyway" >&2
            return 0
        fi
        sleep "$delay"
        waited=$(( waited + delay ))
        delay=$(( delay < 8 ? delay * 2 : 8 ))
    done
}

if [[ "${K_MPI_JOB_ROLE:-}" == "launcher" && -r "$hostfile" ]]; then
    while read -r line || [[ -n "$line" ]]; do
        host=${line%%[ :]*}
        [[ -n "$host" && "$host" != \#* ]] && wait_for_host "$host"
    done < "$hostfile"
fi

exec "$@"
