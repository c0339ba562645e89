#!/usr/bin/env bash
# check-fatbin.sh: fail when csrc/ (or the headers the kernels include)
# changed and zero_kernels.fatbin was not regenerated with `make cuda`. The
# stamp holds the nvrtc version and a hash of the sources and flags; this
# recomputes the hash without any CUDA. With REBUILD=1 and the wheels of
# scripts/install-cuda.sh, it also rebuilds the fatbin and compares bytes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ -f zero_kernels.stamp && -f zero_kernels.fatbin ]] || { echo "check-fatbin: zero_kernels.fatbin or its stamp is missing; run make cuda" >&2; exit 1; }
version=$(sed -n 's/^nvrtc //p' zero_kernels.stamp)
want=$(sed -n 2p zero_kernels.stamp)
got=$(python3 scripts/build-fatbin.py --stamp-only --nvrtc-version "$version")
if [[ $got != "$want" ]]; then
	echo "check-fatbin: the kernel sources changed since zero_kernels.fatbin was built (stamp $want, sources $got); run make cuda and commit zero_kernels.fatbin and zero_kernels.stamp" >&2
	exit 1
fi
if [[ ${REBUILD:-0} == 1 ]]; then
	home=${ZERO_CUDA_HOME:-.cuda}
	cp zero_kernels.fatbin /tmp/zero_kernels.fatbin.committed.$$
	python3 scripts/build-fatbin.py --lib "$home/nvidia/cuda_nvrtc/lib" --lib "$home/nvidia/nvfatbin/lib" >/dev/null
	if ! cmp -s zero_kernels.fatbin /tmp/zero_kernels.fatbin.committed.$$; then
		mv /tmp/zero_kernels.fatbin.committed.$$ zero_kernels.fatbin
		echo "check-fatbin: a rebuild from the sources gives another fatbin than the committed one" >&2
		exit 1
	fi
	rm -f /tmp/zero_kernels.fatbin.committed.$$
fi
echo "check-fatbin: zero_kernels.fatbin matches csrc/ (stamp $want)"
