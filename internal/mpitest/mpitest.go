// Package mpitest finds the MPI that the commands' tests run their ranks
// under, as processes of an mpiexec job.
package mpitest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"zero"
)

// Find returns mpiexec and its libmpi.so.12 (or Debian's libmpich.so.12).
// MPI comes from ZERO_MPI_HOME (set by .ci/run: a missing MPI fails the
// test), else .mpi/ at the repository root (the commands' tests run two
// folders below it) or an mpiexec on PATH; without any the test skips,
// naming what to install.
func Find(t testing.TB) (mpiexec, library string) {
	t.Helper()
	home := os.Getenv("ZERO_MPI_HOME")
	required := home != "" || os.Getenv("CI") == "true"
	homes := []string{home}
	if home == "" {
		homes = []string{"../../.mpi"}
		if p, err := exec.LookPath("mpiexec"); err == nil {
			homes = append(homes, filepath.Dir(filepath.Dir(p)))
		}
	}
	var tried []string
	for _, h := range homes {
		h, _ = filepath.Abs(h)
		mpiexec = filepath.Join(h, "bin", "mpiexec")
		for _, lib := range []string{filepath.Join(h, "lib", "libmpi.so.12"), filepath.Join(h, "lib", "x86_64-linux-gnu", "libmpich.so.12")} {
			if _, err := os.Stat(mpiexec); err != nil {
				tried = append(tried, err.Error())
				break
			}
			if _, _, err := zero.MPIVersion(lib); err != nil {
				tried = append(tried, err.Error())
				continue
			}
			return mpiexec, lib
		}
	}
	msg := fmt.Sprintf("no MPI found (%s): run scripts/install-mpi.sh and set ZERO_MPI_HOME to the folder it prints (.ci/run does), or apt-get install mpich", strings.Join(tried, "; "))
	if required {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return "", ""
}
