// Package mpitest finds the MPI that the commands' tests run their ranks
// under, and runs those ranks as processes of an mpiexec job.
package mpitest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"zero"
)

// Worker is the test that is one rank of a job Run started: where the
// variable env is set it runs main with that variable's fields as arguments
// and exits with its code; elsewhere it skips.
func Worker(t testing.TB, env string, main func(args []string, stdout, stderr io.Writer) int) {
	args := os.Getenv(env)
	if args == "" {
		t.Skip("a rank of the MPI runs: runs under mpiexec only")
	}
	os.Exit(main(strings.Fields(args), os.Stdout, os.Stderr))
}

// Run starts n ranks of this test binary under mpiexec, each running the
// test named worker with env added to its environment, and returns what the
// ranks wrote and mpiexec's exit. A job still running after two minutes is
// a hang: it is killed, its process group with it, and t fails.
func Run(t testing.TB, n int, worker string, env ...string) (stdout, stderr string, err error) {
	t.Helper()
	mpiexec, lib := Find(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, mpiexec, "-n", strconv.Itoa(n), os.Args[0], "-test.run=^"+worker+"$")
	cmd.Env = append(append(os.Environ(), "ZERO_MPI_LIBRARY="+lib), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// on the timeout: SIGINT, on which Hydra ends every process
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	var out, errs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errs
	err = cmd.Run()
	if cmd.Process != nil {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // nothing of the job outlives it
	}
	if ctx.Err() != nil {
		t.Fatalf("mpiexec -n %d %s hung: killed after 2 minutes\n%s%s", n, worker, out.String(), errs.String())
	}
	return out.String(), errs.String(), err
}

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
