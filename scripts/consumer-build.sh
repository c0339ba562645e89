#!/usr/bin/env bash
# consumer-build.sh: show that a module using zero builds with -tags cuda on a
# machine with no CUDA at all, three ways: through a replace directive, from
# a vendored copy (go mod vendor, -mod=vendor), and from a read-only copy of
# the module (as the module cache holds it). The binary then starts and says
# what is missing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export CGO_CFLAGS="${CGO_CFLAGS:--O2 -g} -Wno-deprecated-declarations" # go-nvml's header
work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT

# a read-only copy of the module's files, as in the module cache
mkdir -p "$work/zero"
git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && xargs -0 cp --parents -t "$work/zero")
chmod -R a-w "$work/zero"

consumer() { # dir, path of zero
	mkdir -p "$1"
	cat >"$1/go.mod" <<MOD
module consumer

go 1.26

require zero v0.0.0

replace zero => $2
MOD
	cat >"$1/main.go" <<'GO'
package main

import (
	"errors"
	"fmt"
	"os"

	"zero"
)

func main() {
	_, err := zero.CUDA(0)
	fmt.Println("CUDA(0):", err)
	if err != nil && !errors.Is(err, zero.ErrNoCUDA) && !errors.Is(err, zero.ErrDevice) {
		os.Exit(1)
	}
}
GO
	(cd "$1" && GOFLAGS=-mod=mod go mod tidy >/dev/null 2>&1 || true)
	(cd "$1" && GOFLAGS=-mod=mod go mod tidy)
}

echo "== replace, read-only module"
consumer "$work/a" "$work/zero"
(cd "$work/a" && go build -tags cuda -o app . && ./app)

echo "== go mod vendor, -mod=vendor"
consumer "$work/b" "$root"
(cd "$work/b" && go mod vendor && chmod -R a-w vendor && go build -mod=vendor -tags cuda -o app . && ./app)
echo "consumer-build: all three builds passed"
