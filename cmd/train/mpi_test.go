package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"zero/internal/mpitest"
)

// The MPI runs of the command: this test binary, started by mpiexec with
// ZERO_TRAIN_ARGS set, runs TestTrainMPIWorker, which is the command with
// those arguments on one rank (mpitest.Run starts them).

// TestTrainMPIWorker is one rank of an MPI job of the command.
func TestTrainMPIWorker(t *testing.T) { mpitest.Worker(t, "ZERO_TRAIN_ARGS", mainArgs) }

// mpiTrain runs the command under mpiexec -n n with args (and -mpi) and
// returns its output and mpiexec's exit.
func mpiTrain(t *testing.T, n int, args string) (string, error) {
	t.Helper()
	out, errs, err := mpitest.Run(t, n, "TestTrainMPIWorker", "ZERO_TRAIN_ARGS=-mpi "+args)
	return out + errs, err
}

// TestMPIMatchesInProcess: `mpiexec -n W train -mpi` gives, bit for bit,
// the parameters after every step and the losses of `train -world W` in one
// process: every stage, the three dtypes, offload, windows of both kinds.
func TestMPIMatchesInProcess(t *testing.T) {
	seed := testSeed(t)
	for _, tc := range []struct {
		world int
		args  string
	}{
		{2, "-stage 1 -accum 2 -window coalesce"},
		{2, "-stage 2 -accum 3 -window nosync -offload -bf16"},
		{2, "-stage 3 -accum 2 -window coalesce -offload"},
		{3, "-stage 2 -fp16"},
		{4, "-stage 3 -accum 2 -window nosync -bf16"},
		{3, "-stage 1 -accum 3 -offload -batch 36"},
	} {
		args := fmt.Sprintf("%s -steps 6 -seed %d", tc.args, seed)
		t.Run(fmt.Sprintf("W%d %s", tc.world, tc.args), func(t *testing.T) {
			fs := strings.Fields(fmt.Sprintf("-world %d %s", tc.world, args))
			// the in-process run of the same flags
			file := filepath.Join(t.TempDir(), "local.json")
			if code := mainArgs(append(fs, "-record", file), &bytes.Buffer{}, os.Stderr); code != 0 {
				t.Fatalf("train %s: exit %d", strings.Join(fs, " "), code)
			}
			want := readRecord(t, file)
			mfile := filepath.Join(t.TempDir(), "mpi.json")
			out, err := mpiTrain(t, tc.world, args+" -record "+mfile)
			if err != nil {
				t.Fatalf("mpiexec: %v\n%s", err, out)
			}
			got := readRecord(t, mfile)
			if len(got.Loss) != 6 || len(got.Params) != 7 {
				t.Fatalf("the MPI run recorded %d losses and %d parameter sets, want 6 and 7\n%s", len(got.Loss), len(got.Params), out)
			}
			for st := range want.Loss {
				if math.Float64bits(got.Loss[st]) != math.Float64bits(want.Loss[st]) {
					t.Errorf("step %d: loss %v over MPI, %v in one process", st+1, got.Loss[st], want.Loss[st])
				}
			}
			for st := range want.Params {
				for p := range want.Params[st] {
					for i, w := range want.Params[st][p] {
						if g := got.Params[st][p][i]; math.Float64bits(g) != math.Float64bits(w) {
							t.Fatalf("after step %d, %s[%d] = %v over MPI, %v in one process", st, tensorNames[p], i, g, w)
						}
					}
				}
			}
			if !strings.Contains(out, fmt.Sprintf("on %d MPI processes", tc.world)) {
				t.Errorf("rank 0's header is missing:\n%s", out)
			}
		})
	}
}

func readRecord(t *testing.T, file string) record {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var r record
	if err := json.Unmarshal(data, &r); err != nil {
		t.Fatal(err)
	}
	return r
}
