package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"zero/internal/mpitest"
)

// TestDemoMPIWorker is one rank of `mpiexec -n W demo -mpi`: the test
// binary, started by mpiexec with ZERO_DEMO_ARGS set.
func TestDemoMPIWorker(t *testing.T) {
	args := os.Getenv("ZERO_DEMO_ARGS")
	if args == "" {
		t.Skip("a rank of the MPI runs: runs under mpiexec only")
	}
	os.Exit(mainArgs(strings.Fields(args), os.Stdout, os.Stderr))
}

// TestDemoMPIMatchesInProcess: the rows of `mpiexec -n 2 demo -mpi` are the
// in-process group's, but for the times: every stage and mode, the same
// buckets, collectives, bytes and memory, and the same largest error (the
// same gradient bits), printed by rank 0 alone.
func TestDemoMPIMatchesInProcess(t *testing.T) {
	mpiexec, lib := mpitest.Find(t)
	args := "-layers 2 -hidden 64 -n 2 -steps 1 -json -q"
	var want bytes.Buffer
	if code := mainArgs(strings.Fields("-world 2 "+args), &want, io.Discard); code != 0 {
		t.Fatalf("demo -world 2 %s: exit %d", args, code)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, mpiexec, "-n", "2", os.Args[0], "-test.run=^TestDemoMPIWorker$")
	cmd.Env = append(os.Environ(), "ZERO_DEMO_ARGS=-mpi "+args, "ZERO_MPI_LIBRARY="+lib)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	var got, errs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &got, &errs
	err := cmd.Run()
	if cmd.Process != nil {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	if ctx.Err() != nil || err != nil {
		t.Fatalf("mpiexec -n 2 demo -mpi %s: %v\n%s%s", args, err, got.String(), errs.String())
	}
	rows := func(b []byte) []Row {
		var out []Row
		dec := json.NewDecoder(bytes.NewReader(b))
		for dec.More() {
			var r Row
			if err := dec.Decode(&r); err != nil {
				t.Fatalf("%v in\n%s", err, b)
			}
			r.WallMs, r.WallsMs, r.ReduceMs, r.ExposedMs, r.BucketMs = 0, nil, 0, 0, 0
			out = append(out, r)
		}
		return out
	}
	w, g := rows(want.Bytes()), rows(got.Bytes())
	if len(w) != 12 || len(g) != len(w) {
		t.Fatalf("%d rows over MPI (rank 0 alone prints), %d in one process, want 12 each\n%s", len(g), len(w), got.String())
	}
	for i := range w {
		wj, _ := json.Marshal(w[i])
		gj, _ := json.Marshal(g[i])
		if !bytes.Equal(wj, gj) {
			t.Errorf("row %d:\n  MPI        %s\n  in-process %s", i, gj, wj)
		}
	}
}
