#!/usr/bin/env bash
# install-mpi.sh: install MPICH from PyPI's mpich wheel into a local folder,
# with no root: libmpi.so.12 (MPICH's ABI), libmpi_abi.so.1 (the MPI 5.0
# standard ABI), mpiexec (Hydra) and mpicc, for the MPI tests and
# benchmarks. Idempotent: a second run with the same pin does nothing.
# Prints the folder, which the tests take from ZERO_MPI_HOME (.ci/run sets it).
#
#   scripts/install-mpi.sh            # into .mpi/ at the repository root
#   ZERO_MPI_HOME=/opt/mpi scripts/install-mpi.sh
#
# The system's MPICH works as well (apt-get install mpich: mpiexec on PATH,
# libmpi.so.12 on the loader's path); set ZERO_MPI_HOME to /usr then.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${ZERO_MPI_HOME:-$root/.mpi}
python=${PYTHON:-python3}

pins=(mpich==5.0.2)
stamp="$dest/.zero-mpi-pins"
want=$(printf '%s\n' "${pins[@]}")

if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
	echo "install-mpi: up to date in $dest" >&2
else
	tmp="$dest.tmp.$$"
	rm -rf "$tmp"
	trap 'rm -rf "$tmp"' EXIT
	# --prefix, not --target: the wheel's bin/ and lib/ are data files,
	# which --target drops.
	"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-cache-dir --no-compile \
		--no-deps --only-binary=:all: --no-warn-script-location --prefix "$tmp" "${pins[@]}"
	rm -rf "$tmp"/lib/python* # the wheel's empty Python package
	rm -rf "$dest"
	mv "$tmp" "$dest"
	trap - EXIT
	printf '%s\n' "$want" >"$stamp"
	echo "install-mpi: installed ${pins[*]} into $dest" >&2
fi
# fails here, not in the tests
"$dest/bin/mpiexec" -n 1 true
test -f "$dest/lib/libmpi.so.12"
echo "$dest"
