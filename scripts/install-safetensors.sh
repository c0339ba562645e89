#!/usr/bin/env bash
# install-safetensors.sh: install, from PyPI into a local folder, Python's
# safetensors and numpy (its numpy API needs it), pinned, for
# TestSafetensorsPython: Python reads zero's export and writes a file zero
# imports. Idempotent: a second run with the same pins does nothing. Prints
# the folder, which the test takes from ZERO_SAFETENSORS_PY (.ci/run sets it).
#
#   scripts/install-safetensors.sh            # into .pydeps/ at the repository root
#   ZERO_PY_HOME=/opt/zp scripts/install-safetensors.sh
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${ZERO_PY_HOME:-$root/.pydeps}
python=${PYTHON:-python3}

pins=(
	safetensors==0.8.0
	numpy==2.4.6
)
stamp="$dest/.zero-py-pins"
want=$(printf '%s\n' "${pins[@]}")

if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
	echo "install-safetensors: up to date in $dest" >&2
else
	tmp="$dest.tmp.$$"
	rm -rf "$tmp"
	trap 'rm -rf "$tmp"' EXIT
	# One pip call: --target does not merge into an existing folder.
	"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-cache-dir --no-compile \
		--no-deps --only-binary=:all: --target "$tmp" "${pins[@]}"
	rm -rf "$dest"
	mv "$tmp" "$dest"
	trap - EXIT
	printf '%s\n' "$want" >"$stamp"
	echo "install-safetensors: installed ${pins[*]} into $dest" >&2
fi
PYTHONPATH="$dest" "$python" -c 'import numpy, safetensors.numpy' # fails here, not in the test
echo "$dest"
