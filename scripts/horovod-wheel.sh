#!/usr/bin/env bash
# Builds (once) and prints the path of the patched Horovod 0.28.1 wheel: the build ships in the distribution
# (nightshift/horovod_build/horovod-wheel.sh, which says what it patches and where it caches the wheel).
#
# usage: scripts/horovod-wheel.sh PYTHON
exec "$(cd "$(dirname "$0")/.." && pwd)/nightshift/horovod_build/horovod-wheel.sh" "$@"
