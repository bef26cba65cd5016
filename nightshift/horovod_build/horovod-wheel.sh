#!/usr/bin/env bash
# Builds (once) and prints the path of a Horovod 0.28.1 wheel patched for PyTorch >= 2.1 and for elastic
# jobs whose hosts join late and whose driver discovers hosts without a spawned interpreter
# (horovod-0.28.1-elastic-join.patch, beside this script).
#
# Horovod 0.28.1 asks CMake for C++14; PyTorch 2.x headers need C++17 (upstream horovod#3996,
# fixed on master by #3998 after the last release). We patch the two CMakeLists.txt of the sdist
# and build against the torch already installed in the given interpreter. The wheel is cached
# outside the repository, so later set-ups (and CI on the same machine) reuse it.
#
# It ships in the nightshift distribution (package data of nightshift.horovod_build): `nightshift doctor
# --build-horovod` runs it from an installed wheel, `make` from this checkout (through scripts/horovod-wheel.sh).
#
# usage: horovod-wheel.sh PYTHON
set -euo pipefail

python=${1:?usage: horovod-wheel.sh PYTHON}
cache=${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}
torch_version=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')
# The patch is part of the cache key: a wheel built before it changed is not reused.
patch_file="$(cd "$(dirname "$0")" && pwd)/horovod-0.28.1-elastic-join.patch"
patch_id=$(sha256sum "$patch_file" | cut -c1-12)
wheel_dir="$cache/wheels/horovod-0.28.1-torch$torch_version-$patch_id"

existing=$(ls "$wheel_dir"/horovod-0.28.1-*.whl 2>/dev/null | head -n 1 || true)
if [[ -n "$existing" ]]; then
    echo "$existing"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building Horovod 0.28.1 against torch $torch_version (about 6 minutes on 2 cores)" >&2
"$python" -m pip download --quiet --no-deps --no-binary :all: horovod==0.28.1 -d "$work" >&2
tar -xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
src="$work/horovod-0.28.1"
for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { echo "unexpected sdist: no C++14 line in $f" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
done
patch -d "$src" -p1 --forward --quiet < "$patch_file" >&2
"$python" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi setuptools wheel >&2
mkdir -p "$wheel_dir"
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$python" -m pip wheel --no-deps --no-build-isolation -w "$work/dist" "$src" >&2
mv "$work"/dist/horovod-0.28.1-*.whl "$wheel_dir"/
ls "$wheel_dir"/horovod-0.28.1-*.whl | head -n 1
