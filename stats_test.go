package zero

import (
	"fmt"
	"testing"
	"time"
)

// TestWindowSumsReleased: a window's sums stay pooled from window to window
// (a steady loop of windows allocates nothing), are freed when a backward
// begins outside a window (the steps without one hold the shard and the
// staging buffers only, and allocate nothing either), and come back with
// the next window. In use: the shard and the sums at the window's end, the
// shard alone at Step.
func TestWindowSumsReleased(t *testing.T) {
	params := []Param{{Name: "w", Count: 4000, DType: BF16}, {Name: "b", Count: 900, DType: BF16}, {Name: "c", Count: 3000, DType: BF16}}
	cfg := Config{Stage: 2, BucketBytes: 4096, Overlap: true}
	cfg.Window.DType = BF16
	windows := []bool{true, true, false, false, true}
	comms, err := NewLocalGroup(2)
	if err != nil {
		t.Fatal(err)
	}
	type after struct {
		st     Stats
		allocs int32
	}
	got := make([][]after, 2)
	var plan *Plan
	errs := eachRank(2, func(rank int) error {
		dev := newCountingDevice()
		defer dev.release()
		e, err := New(cfg, onDevice{comms[rank], dev}, params)
		if err != nil {
			return err
		}
		defer e.Close()
		if rank == 0 {
			plan = e.Plan()
		}
		s := NewHostStream()
		defer s.Close()
		grads := bf16Grads(params, 1)
		for _, w := range windows {
			run := func() error {
				for range 2 {
					if err := backward(e, s, grads); err != nil {
						return err
					}
				}
				return nil
			}
			if w {
				err = e.Coalesce(run)
			} else {
				err = run()
			}
			if err == nil {
				err = e.Step()
			}
			if err != nil {
				return err
			}
			got[rank] = append(got[rank], after{e.Stats(), dev.allocs.Load()})
		}
		return nil
	})
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	sums := int64(0)
	for _, b := range plan.Buckets {
		sums += int64(b.Padded * 2)
	}
	shard := int64(plan.ShardElems * 4)
	for rank, steps := range got {
		staging := int64(steps[2].st.StagingBuffers * plan.MaxBucket() * 2)
		for i, a := range steps {
			what := fmt.Sprintf("rank %d step %d (window %v)", rank, i, windows[i])
			st := a.st
			if st.GradBytesInUse != shard || st.GradBytesInUse != st.ResidentGradBytes-st.PooledGradBytes {
				t.Errorf("%s: %d bytes in use at Step, %d held, %d pooled; want the shard's %d in use", what, st.GradBytesInUse, st.ResidentGradBytes, st.PooledGradBytes, shard)
			}
			if windows[i] {
				if st.WindowGradBytesInUse != shard+sums {
					t.Errorf("%s: %d bytes in use at the window's end, want the shard and the sums, %d + %d", what, st.WindowGradBytesInUse, shard, sums)
				}
				if st.ResidentGradBytes < shard+staging+sums {
					t.Errorf("%s: %d bytes held after the flush, want the sums kept (≥ %d)", what, st.ResidentGradBytes, shard+staging+sums)
				}
			} else if st.ResidentGradBytes != shard+staging {
				t.Errorf("%s: %d bytes held without a window, want the shard and the staging buffers, %d + %d (the window's sums freed)", what, st.ResidentGradBytes, shard, staging)
			}
			if st.PeakGradBytesInUse < st.WindowGradBytesInUse || st.PeakGradBytes < st.ResidentGradBytes {
				t.Errorf("%s: peaks %d in use, %d held, below the window's %d or the resident %d", what, st.PeakGradBytesInUse, st.PeakGradBytes, st.WindowGradBytesInUse, st.ResidentGradBytes)
			}
		}
		for _, i := range []int{1, 3} { // the second of two alike steps
			if steps[i].allocs != steps[i-1].allocs {
				t.Errorf("rank %d step %d: %d allocations after a step alike, want none", rank, i, steps[i].allocs-steps[i-1].allocs)
			}
		}
		if steps[4].st.ResidentGradBytes != steps[0].st.ResidentGradBytes {
			t.Errorf("rank %d: the window after steps without one holds %d bytes, the first %d", rank, steps[4].st.ResidentGradBytes, steps[0].st.ResidentGradBytes)
		}
	}
}

// TestExposedReduceTime: the exposed time runs from the window's last
// backward's end to its last reduction's end. A coalesced window flushed
// 30 ms after its last backward ended exposes at least that and every
// reduction; reductions that all ended while backward was still open
// expose nothing.
func TestExposedReduceTime(t *testing.T) {
	const pause = 30 * time.Millisecond
	params := []Param{{Name: "w", Count: 4000, DType: BF16}, {Name: "b", Count: 900, DType: BF16}}
	cfg := Config{Stage: 2, BucketBytes: 4096, Overlap: true}
	for _, window := range []bool{true, false} {
		stats := make([]Stats, 2)
		errs := onEngines(2, time.Minute, cfg, params, func(e *Engine, s *HostStream) error {
			grads := bf16Grads(params, 1)
			report := func() error {
				for p := len(params) - 1; p >= 0; p-- {
					if _, err := e.GradReady(p, grads[p], s); err != nil {
						return err
					}
				}
				return s.Sync() // every gradient read: the backward's end is now
			}
			for range 2 { // the first step warms the pools
				var err error
				if window {
					err = e.Coalesce(func() error {
						if err := report(); err != nil {
							return err
						}
						if err := e.EndBackward(); err != nil {
							return err
						}
						time.Sleep(pause) // then EndCoalesce flushes
						return nil
					})
				} else if err = report(); err == nil {
					time.Sleep(pause) // every bucket was issued by its last GradReady
					err = e.EndBackward()
				}
				if err == nil {
					err = e.Step()
				}
				if err != nil {
					return err
				}
			}
			stats[e.Rank()] = e.Stats()
			return nil
		})
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		for rank, st := range stats {
			if st.ReduceTime <= 0 || st.LastReduceTime <= 0 || st.LastReduceTime > st.ReduceTime {
				t.Fatalf("window %v rank %d: reductions took %v, the last %v", window, rank, st.ReduceTime, st.LastReduceTime)
			}
			if window && (st.ExposedReduceTime < pause || st.ExposedReduceTime < st.ReduceTime) {
				t.Errorf("rank %d: the flush %v after the backward's end exposed %v; want at least the pause and the reductions' %v", rank, pause, st.ExposedReduceTime, st.ReduceTime)
			}
			if !window && st.ExposedReduceTime != 0 {
				t.Errorf("rank %d: reductions that ended %v before the backward exposed %v, want 0", rank, pause, st.ExposedReduceTime)
			}
		}
	}
}
