package main

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"testing"

	"zero/internal/mpitest"
)

// TestDemoMPIWorker is one rank of `mpiexec -n W demo -mpi`: the test
// binary, started by mpiexec with ZERO_DEMO_ARGS set.
func TestDemoMPIWorker(t *testing.T) { mpitest.Worker(t, "ZERO_DEMO_ARGS", mainArgs) }

// TestDemoMPIMatchesInProcess: the rows of `mpiexec -n 2 demo -mpi` are the
// in-process group's, but for the times: every stage and mode, the same
// buckets, collectives, bytes and memory, and the same largest error (the
// same gradient bits), printed by rank 0 alone.
func TestDemoMPIMatchesInProcess(t *testing.T) {
	args := "-layers 2 -hidden 64 -n 2 -steps 1 -json -q"
	var want bytes.Buffer
	if code := mainArgs(strings.Fields("-world 2 "+args), &want, io.Discard); code != 0 {
		t.Fatalf("demo -world 2 %s: exit %d", args, code)
	}
	got, errs, err := mpitest.Run(t, 2, "TestDemoMPIWorker", "ZERO_DEMO_ARGS=-mpi "+args)
	if err != nil {
		t.Fatalf("mpiexec -n 2 demo -mpi %s: %v\n%s%s", args, err, got, errs)
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
	w, g := rows(want.Bytes()), rows([]byte(got))
	if len(w) != 12 || len(g) != len(w) {
		t.Fatalf("%d rows over MPI (rank 0 alone prints), %d in one process, want 12 each\n%s", len(g), len(w), got)
	}
	for i := range w {
		wj, _ := json.Marshal(w[i])
		gj, _ := json.Marshal(g[i])
		if !bytes.Equal(wj, gj) {
			t.Errorf("row %d:\n  MPI        %s\n  in-process %s", i, gj, wj)
		}
	}
}
