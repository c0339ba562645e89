package zero

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// Slips a user makes, each with the error it must give and the words its
// message must say, in that order: what was observed first, then what to
// do. Where the engine goes on, the next step's mean must be right.

// slip is one case: run provokes it and returns the error to judge
// (rank 0's, where several ranks run).
type slip struct {
	name  string
	run   func(t *testing.T) error
	kinds []error
	says  []string // each found after the one before it
}

// withMemory is errTableParams with memory: stage 3 shards them.
func withMemory() []Param {
	ps := append([]Param(nil), errTableParams...)
	for p := range ps {
		ps[p].Data = Float32s(make([]float32, ps[p].Count))
	}
	return ps
}

// stage3Rank is a one-rank stage-3 engine over withMemory's parameters.
func stage3Rank(t *testing.T, cfg Config) (*Engine, *HostStream, []Param) {
	t.Helper()
	comms, _ := NewLocalGroup(1)
	ps := withMemory()
	cfg.Stage = 3
	if cfg.BucketBytes == 0 {
		cfg.BucketBytes = 1024
	}
	e, err := New(cfg, comms[0], ps)
	if err != nil {
		t.Fatal(err)
	}
	s := NewHostStream()
	t.Cleanup(func() { e.Close(); s.Close() })
	return e, s, ps
}

// handOver hands over every parameter's gradient (all v) in backward
// order, with no forward, as a loop written for stage 2 does.
func handOver(e *Engine, s Stream, ps []Param, v float32) error {
	g := constGrads(ps, v)
	for p := len(ps) - 1; p >= 0; p-- {
		if _, err := e.GradReady(p, g[p], s); err != nil {
			return err
		}
	}
	return e.EndBackward()
}

// gatherAll gathers every parameter on s and releases it: a forward.
func gatherAll(e *Engine, s Stream, ps []Param) error {
	ids := make([]int, len(ps))
	for p := range ids {
		ids[p] = p
	}
	if _, err := e.Gather(s, ids...); err != nil {
		return err
	}
	return e.Release(s, ids...)
}

// meanIs takes a Step and wants every element of the mean gradient v.
func meanIs(t *testing.T, e *Engine, v float32) {
	t.Helper()
	if err := e.Step(); err != nil {
		t.Fatalf("Step: %v", err)
	}
	full, err := e.FullGrads()
	if err != nil {
		t.Fatal(err)
	}
	if err := wantAll(full, v); err != nil {
		t.Fatalf("the mean after the slip: %v", err)
	}
}

var slips = []slip{
	// Stage 3 with a loop written for stage 2: the forward read Param.Data,
	// which holds the initial values forever.
	{"stage 3, no Gather at all", func(t *testing.T) error {
		e, s, ps := stage3Rank(t, Config{})
		err := handOver(e, s, ps, 1)
		// nothing was taken: the loop with its forward goes on
		if err := gatherAll(e, s, ps); err != nil {
			t.Fatal(err)
		}
		if err := handOver(e, s, ps, 3); err != nil {
			t.Fatal(err)
		}
		meanIs(t, e, 3)
		return err
	}, []error{ErrParam}, []string{`GradReady(1 "b") at stage 3`, "no Gather of it since the last Step", "Param.Data is read at New only", "Gather's view"}},

	{"stage 3, the engine's prefetch does not count", func(t *testing.T) error {
		e, s, ps := stage3Rank(t, Config{Params: ParamPolicy{PrefetchBytes: 1 << 20}})
		if err := gatherAll(e, s, ps); err != nil {
			t.Fatal(err)
		}
		if err := handOver(e, s, ps, 1); err != nil {
			t.Fatal(err)
		}
		meanIs(t, e, 1)
		if e.ParamMemory().GatheredBuckets == 0 {
			t.Fatal("nothing prefetched after Step: the case tests nothing")
		}
		return handOver(e, s, ps, 1) // the prefetched buckets, never asked for
	}, []error{ErrParam}, []string{"no Gather of it since the last Step"}},

	{"stage 3, a Gather of one parameter does not cover another of its bucket", func(t *testing.T) error {
		e, s, ps := stage3Rank(t, Config{BucketBytes: 4096})
		if e.Plan().ParamBucket[0] != e.Plan().ParamBucket[1] {
			t.Fatal("w and b in different buckets: the case tests nothing")
		}
		if _, err := e.Gather(s, 1); err != nil {
			t.Fatal(err)
		}
		if err := e.Release(s, 1); err != nil {
			t.Fatal(err)
		}
		return handOver(e, s, ps, 1)
	}, []error{ErrParam}, []string{`GradReady(0 "w")`, "no Gather of it"}},

	{"failed Coalesce, then EndBackward", func(t *testing.T) error {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		failure := errors.New("the loss was NaN")
		err := e.Coalesce(func() error {
			if err := backward(e, s, constGrads(errTableParams, 5)); err != nil {
				return err
			}
			return failure
		})
		if !errors.Is(err, failure) {
			t.Fatalf("Coalesce: %v, want fn's error", err)
		}
		err = e.EndBackward() // the natural cleanup
		stillWorks(t, e, s)
		return err
	}, []error{ErrProtocol}, []string{"EndBackward right after a failed Coalesce", "would count an empty backward", "leave it out"}},

	{"failed Coalesce in the middle of a backward, then EndBackward", func(t *testing.T) error {
		e, s := oneRank(t, Config{Stage: 1, BucketBytes: 1024})
		err := e.Coalesce(func() error {
			_, err := e.GradReady(1, Float32s(make([]float32, 39)), s) // a wrong size
			return err
		})
		if !errors.Is(err, ErrGradSize) {
			t.Fatalf("Coalesce: %v, want ErrGradSize", err)
		}
		err = e.EndBackward()
		stillWorks(t, e, s)
		return err
	}, []error{ErrProtocol}, []string{"EndBackward right after a failed Coalesce"}},

	{"failed Coalesce, then EndCoalesce", func(t *testing.T) error {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		e.Coalesce(func() error { return errors.New("fn failed") })
		err := e.EndCoalesce()
		stillWorks(t, e, s)
		return err
	}, []error{ErrProtocol}, []string{"EndCoalesce right after a failed Coalesce", "closed its window"}},

	{"failed NoSync, then EndBackward and EndNoSync", func(t *testing.T) error {
		e, s := oneRank(t, Config{Stage: 3, BucketBytes: 1024})
		e.NoSync(func() error {
			backward(e, s, constGrads(errTableParams, 7))
			return errors.New("fn failed")
		})
		if err := e.EndBackward(); !errors.Is(err, ErrProtocol) {
			t.Errorf("EndBackward after the failed NoSync: %v, want ErrProtocol", err)
		}
		err := e.EndNoSync()
		stillWorks(t, e, s)
		return err
	}, []error{ErrProtocol}, []string{"EndNoSync right after a failed NoSync"}},

	{"DiscardGrads in the middle of a backward, then EndBackward", func(t *testing.T) error {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		if _, err := e.GradReady(1, constGrads(errTableParams, 9)[1], s); err != nil {
			t.Fatal(err)
		}
		if err := e.DiscardGrads(); err != nil {
			t.Fatal(err)
		}
		err := e.EndBackward()
		stillWorks(t, e, s)
		return err
	}, []error{ErrProtocol}, []string{"EndBackward right after DiscardGrads"}},

	// Diagnoses: what was seen first (the rank that did not come, what
	// each rank called), the likely causes after.
	{"one rank stops before Step", func(t *testing.T) error {
		errs := twoRanks(200*time.Millisecond, Config{Stage: 2, BucketBytes: 1024}, func(e *Engine, s *HostStream) error {
			if e.Rank() == 1 {
				return nil
			}
			if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
				return err
			}
			return e.Step()
		})
		return errs[0]
	}, []error{ErrCollective, ErrTimeout}, []string{"rank 1 did not arrive within 200ms (rank 0 did)", "same number of backwards"}},

	{"two of three ranks stop", func(t *testing.T) error {
		errs := onEngines(3, 200*time.Millisecond, Config{Stage: 2, BucketBytes: 1024}, errTableParams, func(e *Engine, s *HostStream) error {
			if e.Rank() > 0 {
				return nil
			}
			if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
				return err
			}
			return e.Step()
		})
		return errs[0]
	}, []error{ErrCollective, ErrTimeout}, []string{"on rank 0): ranks 1 and 2 did not arrive within 200ms (rank 0 did)", "same number of backwards"}},

	{"a backward more on one rank", func(t *testing.T) error {
		errs := twoRanks(5*time.Second, Config{Stage: 2, BucketBytes: 1024}, func(e *Engine, s *HostStream) error {
			for range 2 - e.Rank() {
				if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
					return err
				}
			}
			return e.Step()
		})
		if !errors.Is(errs[1], ErrCollectiveMismatch) {
			t.Errorf("rank 1: %v, want ErrCollectiveMismatch", errs[1])
		}
		return errs[0]
	}, []error{ErrCollective, ErrCollectiveMismatch}, []string{"rank 0 called reduce_scatter(", "rank 1 called all_reduce(", "same number of backwards"}},

	{"FullGrads on one rank only", func(t *testing.T) error {
		errs := twoRanks(5*time.Second, Config{Stage: 2, BucketBytes: 1024}, func(e *Engine, s *HostStream) error {
			if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
			if e.Rank() == 1 {
				if _, err := e.FullGrads(); err != nil {
					return err
				}
			}
			// the reduction may fail after the backward returned: Step
			// waits for it
			if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
				return err
			}
			return e.Step()
		})
		return errs[0]
	}, []error{ErrCollective, ErrCollectiveMismatch}, []string{"rank 0 called reduce_scatter(", "rank 1 called all_gather("}},
}

// TestSlipsAreNamed runs every slip: the error it must give, and the words
// its message must say, in order.
func TestSlipsAreNamed(t *testing.T) {
	for _, c := range slips {
		t.Run(c.name, func(t *testing.T) {
			err := c.run(t)
			for _, k := range c.kinds {
				if !errors.Is(err, k) {
					t.Fatalf("%v\nwant it to wrap %v", err, k)
				}
			}
			msg, at := fmt.Sprint(err), 0
			for _, w := range c.says {
				i := strings.Index(msg[at:], w)
				if i < 0 {
					t.Fatalf("%s\nwant %q (after %q)", msg, w, msg[:at])
				}
				at += i + len(w)
			}
		})
	}
}

// TestStage3OneGatherPerStep: a Gather covers every backward until Step
// (the second backward of a step needs none), and no longer.
func TestStage3OneGatherPerStep(t *testing.T) {
	e, s, ps := stage3Rank(t, Config{Params: ParamPolicy{PrefetchBytes: -1}})
	if err := gatherAll(e, s, ps); err != nil {
		t.Fatal(err)
	}
	for _, v := range []float32{1, 3} {
		if err := handOver(e, s, ps, v); err != nil {
			t.Fatalf("backward with %g: %v", v, err)
		}
	}
	meanIs(t, e, 2)
	if err := handOver(e, s, ps, 1); !errors.Is(err, ErrParam) {
		t.Fatalf("a backward after Step with no Gather: %v, want ErrParam", err)
	}
}

// TestDiscardInsideAWindowKeepsItOpen: DiscardGrads inside a Coalesce
// window or NoSync leaves the window open, so its end is no slip: it is
// taken, and the next step's mean is right.
func TestDiscardInsideAWindowKeepsItOpen(t *testing.T) {
	for _, noSync := range []bool{false, true} {
		e, s := oneRank(t, Config{Stage: 2, BucketBytes: 1024})
		begin, end := e.BeginCoalesce, e.EndCoalesce
		if noSync {
			begin, end = e.BeginNoSync, e.EndNoSync
		}
		if err := begin(); err != nil {
			t.Fatal(err)
		}
		if err := backward(e, s, constGrads(errTableParams, 5)); err != nil {
			t.Fatal(err)
		}
		if err := e.DiscardGrads(); err != nil {
			t.Fatal(err)
		}
		if err := end(); err != nil {
			t.Fatalf("noSync %v: the window's end after DiscardGrads inside it: %v", noSync, err)
		}
		stillWorks(t, e, s)
	}
}
