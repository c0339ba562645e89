#!/usr/bin/env bash
# install-cuda.sh: install the CUDA 13.0 compiler, runtime and headers and the
# NCCL headers (and library) from PyPI into a local folder, for `make cuda`.
# No GPU and no system CUDA are needed. Idempotent: a second run with the same
# pins does nothing. Prints the paths it installed.
#
#   scripts/install-cuda.sh            # into .cuda/ at the repository root
#   ZERO_CUDA_HOME=/opt/zc scripts/install-cuda.sh
#
# The pins match the driver and toolkit of the H100 hosts the project is
# tested on (CUDA 13.0). NCCL is pinned to the oldest CUDA 13 release on PyPI,
# so the ncclConfig_t the library passes is one every later NCCL accepts; at
# run time libnccl.so.2 is dlopen'ed (PyTorch's own NCCL on the GPU hosts).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${ZERO_CUDA_HOME:-$root/.cuda}
python=${PYTHON:-python3}

pins=(
	nvidia-cuda-nvcc==13.0.88
	nvidia-cuda-crt==13.0.88
	nvidia-nvvm==13.0.88
	nvidia-cuda-runtime==13.0.96
	nvidia-cuda-cccl==13.0.85
	nvidia-nccl-cu13==2.27.7
)
stamp="$dest/.zero-cuda-pins"
want=$(printf '%s\n' "${pins[@]}")

if [[ -f $stamp && "$(cat "$stamp")" == "$want" && -x $dest/nvidia/cu13/bin/nvcc ]]; then
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

cu="$dest/nvidia/cu13"
echo "ZERO_CUDA_HOME=$dest"
echo "NVCC=$cu/bin/nvcc"
echo "CUDA_INCLUDE=$cu/include"
echo "CUDA_LIB=$cu/lib"
echo "NCCL_INCLUDE=$dest/nvidia/nccl/include"
echo "NCCL_LIB=$dest/nvidia/nccl/lib"
