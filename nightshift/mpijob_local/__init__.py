"""`nightshift run-mpijob`: an MPIJob run on this machine across emulated hosts, as the MPI Operator would.

Each pod gets its own network, UTS and mount namespaces on a bridge of the run; workers run sshd with the
job's generated key; the launcher sees `/etc/mpi/hostfile`; claims are directories of this machine.
An elastic job (its launcher runs `horovodrun ... --host-discovery-script ...`) sees the running workers in
`/etc/mpi/discover_hosts.sh` and survives a lost one; `--chaos` kills and restores workers on a schedule.
No Airflow here: the manifest (e.g. from `nightshift plan`) is the only input besides the options.
"""

from __future__ import annotations
