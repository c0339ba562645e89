package zero

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The rows of the README's error table, provoked one by one: each row's
// error comes back where the table says, and the engine is left as the
// table says (usable, fatal, aborted, closed, or no engine at all).

// errorRow is one row: its first column as the README spells it, and a
// function that provokes the error and checks what the row promises.
type errorRow struct {
	kind    string
	provoke func(t *testing.T)
}

// want fails t unless err wraps every one of kinds.
func want(t *testing.T, what string, err error, kinds ...error) {
	t.Helper()
	for _, k := range kinds {
		if !errors.Is(err, k) {
			t.Fatalf("%s: %v, want it to wrap %v", what, err, k)
		}
	}
}

// fatalAfter wants every later call refused as the table's "fatal" says:
// ErrCollective and the cause.
func fatalAfter(t *testing.T, e *Engine, cause error) {
	t.Helper()
	want(t, "the call after a fatal error", e.Step(), ErrCollective, cause)
}

// errorComm fails every all-reduce with an error of the caller's own.
type errorComm struct {
	Comm
	err error
}

func (c errorComm) AllReduce(Stream, Tensor, ReduceOp) error { return c.err }

var errorTable = []errorRow{
	{"`ErrConfig`", func(t *testing.T) {
		comms, _ := NewLocalGroup(1)
		if e, err := New(Config{Stage: 4, BucketBytes: 1024}, comms[0], errTableParams); e != nil || !errors.Is(err, ErrConfig) {
			t.Fatalf("Stage 4: %v, %v; want no engine and ErrConfig", e, err)
		}
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		want(t, "SetGroup without an optimizer", e.SetGroup(0, NewSGD(1)), ErrConfig)
		stillWorks(t, e, s)
	}},
	{"`ErrParam`", func(t *testing.T) {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		_, err := e.GradReady(7, Float32s(make([]float32, 40)), s)
		want(t, "GradReady of parameter 7", err, ErrParam)
		stillWorks(t, e, s)
	}},
	{"`ErrDType`", func(t *testing.T) {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		_, err := e.GradReady(1, Halfs(make([]uint16, 40), BF16), s)
		want(t, "a bf16 gradient of an fp32 parameter", err, ErrDType)
		stillWorks(t, e, s)
	}},
	{"`ErrGradSize`", func(t *testing.T) {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		_, err := e.GradReady(1, Float32s(make([]float32, 39)), s)
		want(t, "a gradient of 39 elements", err, ErrGradSize)
		stillWorks(t, e, s)
	}},
	{"`ErrDuplicateGrad`", func(t *testing.T) {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		g := constGrads(errTableParams, 1)
		if _, err := e.GradReady(1, g[1], s); err != nil {
			t.Fatal(err)
		}
		_, err := e.GradReady(1, g[1], s)
		want(t, "a gradient twice", err, ErrDuplicateGrad)
		if _, err := e.GradReady(0, g[0], s); err != nil {
			t.Fatal(err)
		}
		if err := e.EndBackward(); err != nil {
			t.Fatal(err)
		}
		if err := e.Step(); err != nil {
			t.Fatal(err)
		}
		full, _ := e.FullGrads()
		if err := wantAll(full, 1); err != nil {
			t.Fatal(err)
		}
	}},
	{"`ErrProtocol`", func(t *testing.T) {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024, Grads: GradPolicy{AccumSteps: 1}})
		want(t, "Step with no backward", e.Step(), ErrProtocol)
		_, err := e.GradShard()
		want(t, "GradShard before any Step", err, ErrProtocol)
		stillWorks(t, e, s)
	}},
	{"`ErrStream`", func(t *testing.T) {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		closed := NewHostStream()
		closed.Close()
		_, err := e.GradReady(1, Float32s(make([]float32, 40)), closed)
		want(t, "a closed stream", err, ErrStream)
		failed := NewHostStream()
		defer failed.Close()
		boom := errors.New("the framework's kernel failed")
		failed.Launch(func() error { return boom })
		failed.Sync()
		_, err = e.GradReady(1, Float32s(make([]float32, 40)), failed)
		want(t, "a failed stream", err, ErrStream, boom)
		stillWorks(t, e, s)
	}},
	{"`ErrPlanMismatch`", func(t *testing.T) {
		comms, _ := NewLocalGroupTimeout(2, 5*time.Second)
		errs := eachRank(2, func(r int) error {
			e, err := New(Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Clip: float64(r)}}, comms[r], errTableParams)
			if e != nil {
				e.Close()
				return fmt.Errorf("an engine despite differing settings")
			}
			return err
		})
		everyRankIs(t, "Clip differs", errs, ErrPlanMismatch)
	}},
	{"`ErrCollectiveMismatch`", func(t *testing.T) {
		var refused [2]error
		errs := twoRanks(5*time.Second, Config{Stage: 1, BucketBytes: 1024}, func(e *Engine, s *HostStream) error {
			for range 2 - e.Rank() {
				if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
					return err
				}
			}
			refused[e.Rank()] = e.Step()
			if e.Rank() == 1 { // the window was kept: one more backward makes the ranks agree
				if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
					return err
				}
			}
			return e.Step()
		})
		everyRankIs(t, "stage 1, 2 and 1 backwards", refused[:], ErrCollectiveMismatch)
		everyRankIs(t, "then 2 and 2", errs, nil)
	}},
	{"`ErrCollective` + `ErrCollectiveMismatch`", func(t *testing.T) {
		errs := twoRanks(5*time.Second, Config{Stage: 2, BucketBytes: 1024}, func(e *Engine, s *HostStream) error {
			var err error
			for range 2 - e.Rank() {
				if err = backward(e, s, constGrads(errTableParams, 1)); err != nil {
					break
				}
			}
			if err == nil {
				err = e.Step()
			}
			want(t, fmt.Sprintf("rank %d", e.Rank()), err, ErrCollective, ErrCollectiveMismatch)
			fatalAfter(t, e, ErrCollectiveMismatch)
			return nil
		})
		everyRankIs(t, "stage 2, 2 and 1 backwards", errs, nil)
	}},
	{"`ErrCollective` + `ErrTimeout`", func(t *testing.T) {
		comms, _ := NewLocalGroupTimeout(2, 200*time.Millisecond)
		eachRank(2, func(r int) error {
			e, err := New(Config{Stage: 2, BucketBytes: 1024}, comms[r], errTableParams)
			if err != nil {
				t.Error(err)
				return err
			}
			defer e.Close()
			if r == 1 {
				time.Sleep(time.Second) // never comes to Step, never leaves
				return nil
			}
			s := NewHostStream()
			defer s.Close()
			err = backward(e, s, constGrads(errTableParams, 1))
			if err == nil {
				err = e.Step()
			}
			want(t, "rank 0", err, ErrCollective, ErrTimeout)
			fatalAfter(t, e, ErrTimeout)
			return nil
		})
	}},
	{"`ErrCollective` + `ErrPeerFailed`", func(t *testing.T) {
		comms, _ := NewLocalGroupTimeout(2, 5*time.Second)
		eachRank(2, func(r int) error {
			e, err := New(Config{Stage: 2, BucketBytes: 1024}, comms[r], errTableParams)
			if err != nil {
				t.Error(err)
				return err
			}
			defer e.Close()
			if r == 1 {
				comms[1].Close()
				return nil
			}
			s := NewHostStream()
			defer s.Close()
			err = backward(e, s, constGrads(errTableParams, 1))
			if err == nil {
				err = e.Step()
			}
			want(t, "rank 0", err, ErrCollective, ErrPeerFailed)
			fatalAfter(t, e, ErrPeerFailed)
			return nil
		})
	}},
	{"`ErrCollective` + `ErrStream`", func(t *testing.T) {
		e, _ := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		s, open := gateStream()
		defer s.Close()
		boom := errors.New("the framework's kernel failed")
		s.Launch(func() error { return boom }) // runs after the gate, before the engine reads the gradient
		err := backward(e, s, constGrads(errTableParams, 1))
		open()
		if err == nil {
			err = e.Step()
		}
		want(t, "a stream that failed after GradReady", err, ErrCollective, ErrStream, boom)
		fatalAfter(t, e, boom)
	}},
	{"`ErrCollective` + its cause", func(t *testing.T) {
		comms, _ := NewLocalGroup(1)
		mine := errors.New("my communicator's own error")
		e, err := New(Config{Stage: 2, BucketBytes: 1024}, errorComm{comms[0], mine}, errTableParams)
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
			t.Fatal(err)
		}
		want(t, "a Comm of the caller's own failing", e.Step(), ErrCollective, mine)
		fatalAfter(t, e, mine)
	}},
	{"`ErrCheckpoint`", func(t *testing.T) {
		comms, _ := NewLocalGroup(1)
		params, bufs := smallModel(FP32, 0.5)
		e, err := New(Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}, comms[0], params)
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		before := snapshotState(e, bufs)
		_, err = e.Load(t.TempDir(), LoadOptions{})
		want(t, "a Load from a directory with no checkpoint", err, ErrCheckpoint)
		notDir := filepath.Join(t.TempDir(), "file")
		if err := os.WriteFile(notDir, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		want(t, "a Save into a path that is a file", e.Save(notDir, SaveOptions{}), ErrCheckpoint)
		if !snapshotState(e, bufs).equal(before) {
			t.Fatal("a refused Load or Save changed the engine")
		}
		if err := e.Save(t.TempDir(), SaveOptions{}); err != nil {
			t.Fatalf("the engine should go on: %v", err)
		}
	}},
	{"`ErrAborted`", func(t *testing.T) {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		e.Abort(errors.New("the trainer stops"))
		want(t, "a call after Abort", backward(e, s, constGrads(errTableParams, 1)), ErrAborted)
		want(t, "Step after Abort", e.Step(), ErrAborted)
	}},
	{"`ErrClosed`", func(t *testing.T) {
		e, _ := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		e.Close()
		want(t, "Step after Close", e.Step(), ErrClosed)
		comms, _ := NewLocalGroupTimeout(2, 5*time.Second)
		eachRank(2, func(r int) error {
			e, err := New(Config{Stage: 2, BucketBytes: 1024}, comms[r], errTableParams)
			if err != nil {
				t.Error(err)
				return err
			}
			defer e.Close()
			if r == 0 {
				comms[0].Close() // its own
				s := NewHostStream()
				defer s.Close()
				err := backward(e, s, constGrads(errTableParams, 1))
				if err == nil {
					err = e.Step()
				}
				if !errors.Is(err, ErrClosed) || errors.Is(err, ErrPeerFailed) {
					t.Errorf("a Step after closing its own Comm: %v, want ErrClosed and no peer's failure", err)
				}
			}
			return nil
		})
	}},
	{"`ErrOutOfMemory`", func(t *testing.T) {
		comms, _ := NewLocalGroup(1)
		e, err := New(Config{Stage: 2, BucketBytes: 1 << 50}, comms[0], []Param{{Count: 1 << 47, DType: BF16}})
		if e != nil || !errors.Is(err, ErrOutOfMemory) {
			t.Fatalf("a 256 TiB model: %v, %v; want no engine and ErrOutOfMemory", e, err)
		}
		if !errors.Is(&CUDAError{Code: 2}, ErrOutOfMemory) || !errors.Is(&CUDAError{Code: 2}, ErrCUDA) {
			t.Fatal("CUDA's out of memory is not ErrOutOfMemory and ErrCUDA")
		}
	}},
	{"`ErrNoCUDA`", func(t *testing.T) {
		if _, err := CUDA(0); err == nil {
			t.Skip("this host has a GPU and the CUDA build")
		} else if !errors.Is(err, ErrNoCUDA) && !errors.Is(err, ErrDevice) {
			t.Fatalf("CUDA(0): %v, want ErrNoCUDA", err)
		}
	}},
	{"`ErrCUDA`, `ErrNCCL`, `ErrDevice`", func(t *testing.T) {
		if err := (&CUDAError{Code: 700}); !errors.Is(err, ErrCUDA) || errors.Is(err, ErrOutOfMemory) {
			t.Fatalf("an illegal address: %v", err)
		}
		if _, err := AllocPinned(fakeDevice{}, 4, FP32); !errors.Is(err, ErrDevice) {
			t.Fatalf("pinned memory of a device without it: %v, want ErrDevice", err)
		}
	}},
	{"`ErrMPI`", func(t *testing.T) {
		if _, _, err := MPIVersion("/nonexistent/libmpi.so.12"); !errors.Is(err, ErrMPI) || !strings.Contains(err.Error(), "install MPICH") {
			t.Fatalf("a missing MPI: %v, want ErrMPI saying how to install it", err)
		}
		if err := error(&MPIError{Code: 15, Text: "Message truncated"}); !errors.Is(err, ErrMPI) {
			t.Fatalf("an MPI call's error: %v does not wrap ErrMPI", err)
		}
	}},
}

// fakeDevice is a device with no page-locked memory.
type fakeDevice struct{ Device }

func (fakeDevice) Name() string { return "fake" }

// TestErrorTable provokes every row of the README's error table, and holds
// the table to the rows: the same errors, in the same order.
func TestErrorTable(t *testing.T) {
	for _, row := range errorTable {
		t.Run(strings.NewReplacer("`", "", " ", "_").Replace(row.kind), row.provoke)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, _ := strings.Cut(string(readme), "| error | cause | the engine after it | what to do |")
	var kinds []string
	for _, line := range strings.Split(table, "\n")[2:] {
		if !strings.HasPrefix(line, "| ") {
			break
		}
		kinds = append(kinds, strings.TrimSpace(strings.Split(line, "|")[1]))
	}
	var rows []string
	for _, row := range errorTable {
		rows = append(rows, row.kind)
	}
	if strings.Join(kinds, "\n") != strings.Join(rows, "\n") {
		t.Errorf("the README's error table has the rows\n%s\nthe test provokes\n%s", strings.Join(kinds, "\n"), strings.Join(rows, "\n"))
	}
}
