#!/usr/bin/env bash
# install-cuda.sh: install, from PyPI into a local folder, what `make cuda`
# needs to regenerate zero_kernels.fatbin (CUDA 12 nvrtc and nvFatbin: the
# CUDA 12 compiler wheels carry the compiler libraries, not an nvcc binary)
# and the NCCL library the loader tests open. No GPU and no system CUDA are
# needed; building the Go package with -tags cuda needs none of this.
# Idempotent: a second run with the same pins does nothing. Prints the paths.
#
#   scripts/install-cuda.sh            # into .cuda/ at the repository root
#   ZERO_CUDA_HOME=/opt/zc scripts/install-cuda.sh
#
# nvrtc is pinned to CUDA 12.1: its cubins for sm_80 and sm_90 load on every
# driver since CUDA 12.0 (minor-version compatibility), and nvrtc 12.0 fails
# on the kernels' __grid_constant__ parameters (an internal compiler error).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${ZERO_CUDA_HOME:-$root/.cuda}
python=${PYTHON:-python3}

pins=(
	nvidia-cuda-nvrtc-cu12==12.1.105
	nvidia-nvfatbin-cu12==12.4.127
	nvidia-nccl-cu12==2.27.7
)
stamp="$dest/.zero-cuda-pins"
want=$(printf '%s\n' "${pins[@]}")

if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
	echo "install-cuda: up to date in $dest"
else
	tmp="$dest.tmp.$$"
	rm -rf "$tmp"
	trap 'rm -rf "$tmp"' EXIT
	# One pip call: --target does not merge into an existing folder.
	"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-cache-dir --no-compile \
		--no-deps --target "$tmp" "${pins[@]}"
	rm -rf "$dest"
	mv "$tmp" "$dest"
	trap - EXIT
	printf '%s\n' "$want" >"$stamp"
	echo "install-cuda: installed ${pins[*]} into $dest"
fi

echo "ZERO_CUDA_HOME=$dest"
echo "NVRTC_LIB=$dest/nvidia/cuda_nvrtc/lib"
echo "NVFATBIN_LIB=$dest/nvidia/nvfatbin/lib"
echo "NCCL_LIB=$dest/nvidia/nccl/lib"
