package zero

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Tests of the backward protocol's rules: the window Step closes, reads of
// the reduced gradient, errors that must reach the caller on every rank,
// and what Close and the stats account for.

// TestWindowErrors: a Step with no backward, a Step after other than
// GradAccumSteps backwards, and ranks that took different numbers of
// backwards are refused with the same typed error on every rank, and the
// refusal loses nothing.
func TestWindowErrors(t *testing.T) {
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{false, true} {
			name := fmt.Sprintf("stage %d overlap=%v", stage, overlap)
			cfg := Config{Stage: stage, BucketBytes: 1024, Overlap: overlap}
			ones, threes := constGrads(params, 1), constGrads(params, 3)

			// No backward: refused before the first Step and after one; the
			// last window's gradient stays readable.
			var first, later [2]error
			errs := onEngines(2, 20*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
				if _, err := e.GradShard(); !errors.Is(err, ErrProtocol) {
					return fmt.Errorf("GradShard before any Step: %v, want ErrProtocol", err)
				}
				first[e.Rank()] = e.Step()
				if err := backward(e, s, ones); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				later[e.Rank()] = e.Step()
				full, err := e.FullGrads()
				if err != nil {
					return err
				}
				return wantAll(full, 1)
			})
			everyRankIs(t, name, errs, nil)
			everyRankIs(t, name+": Step before any backward", first[:], ErrProtocol)
			everyRankIs(t, name+": second Step", later[:], ErrProtocol)

			// A fixed G: one backward of two is refused, the window is kept,
			// and after the second the mean is over both.
			fixed := cfg
			fixed.Grads.AccumSteps = 2
			var short [2]error
			errs = onEngines(2, 20*time.Second, fixed, params, func(e *Engine, s *HostStream) error {
				if err := backward(e, s, ones); err != nil {
					return err
				}
				short[e.Rank()] = e.Step()
				if err := backward(e, s, threes); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				full, err := e.FullGrads()
				if err != nil {
					return err
				}
				return wantAll(full, 2)
			})
			everyRankIs(t, name, errs, nil)
			everyRankIs(t, name+": 1 backward of GradAccumSteps 2", short[:], ErrProtocol)

			// Rank 1 takes one backward fewer: every rank fails, none hangs,
			// and the error names the cause.
			errs = onEngines(2, 20*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
				for range 2 - e.Rank() {
					if err := backward(e, s, ones); err != nil {
						return err
					}
				}
				return e.Step()
			})
			everyRankIs(t, name+": ranks took 2 and 1 backwards", errs, ErrCollectiveMismatch)
			for r, err := range errs {
				if err != nil && !strings.Contains(err.Error(), "backwards") {
					t.Errorf("%s: ranks took 2 and 1 backwards: rank %d's error does not name the cause: %v", name, r, err)
				}
			}
		}
	}
}

// TestReadsOutsideTheWindow: the reduced gradient cannot be read or
// written while the next window's backward is under way, on any rank; it
// reads again after Step.
func TestReadsOutsideTheWindow(t *testing.T) {
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		cfg := Config{Stage: stage, BucketBytes: 1024, Overlap: true}
		errs := onEngines(2, 20*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
			v, err := e.GradView(2)
			if err != nil {
				return err
			}
			buf := make([]float32, v.Count)
			reads := map[string]func() error{
				"GradShard":  func() error { _, err := e.GradShard(); return err },
				"FullGrads":  func() error { _, err := e.FullGrads(); return err },
				"View.Read":  func() error { return v.Read(buf) },
				"View.Write": func() error { return v.Write(buf) },
			}
			refused := func(when string) error {
				for name, read := range reads {
					if err := read(); !errors.Is(err, ErrProtocol) {
						return fmt.Errorf("%s %s: %v, want ErrProtocol", name, when, err)
					}
				}
				return nil
			}
			if err := refused("before the first Step"); err != nil {
				return err
			}
			if err := backward(e, s, constGrads(params, 1)); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
			if _, err := e.GradReady(7, constGrads(params, 5)[7], s); err != nil {
				return err
			}
			if err := refused("inside the next backward"); err != nil {
				return err
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
			if err := refused("after the next backward"); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
			for name, read := range reads {
				if err := read(); err != nil {
					return fmt.Errorf("%s after Step: %v", name, err)
				}
			}
			return nil
		})
		everyRankIs(t, fmt.Sprintf("stage %d", stage), errs, nil)
	}
}

// faultyComm fails the stream of every reduce-scatter after the real one
// ran, as an NCCL error or a failed kernel would: the error surfaces only
// when someone syncs.
type faultyComm struct {
	Comm
	err error
	// with calls set, only the reduce-scatter numbered *only (from 1) fails
	calls, only *int
}

func (c faultyComm) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	if err := c.Comm.ReduceScatter(s, send, recv, op); err != nil {
		return err
	}
	if c.calls != nil {
		if *c.calls++; *c.calls != *c.only {
			return nil
		}
	}
	return s.(*HostStream).Launch(func() error { return c.err })
}

// TestReductionErrorReachesCaller: a reduction that fails on its stream
// fails Step, with and without Overlap (where it ran on the caller's
// stream) and with offload, and the engine refuses to go on; with offload,
// Close still frees every host byte.
func TestReductionErrorReachesCaller(t *testing.T) {
	boom := errors.New("reduction failed")
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		for _, c := range []struct{ overlap, offload, lastOnly bool }{{false, false, false}, {true, false, false}, {true, true, false},
			{false, false, true}, {true, false, true}, {true, true, true}} {
			what := fmt.Sprintf("stage %d overlap=%v offload=%v only the last reduction fails=%v", stage, c.overlap, c.offload, c.lastOnly)
			comms, _ := NewLocalGroup(1)
			fc := faultyComm{Comm: comms[0], err: boom}
			if c.lastOnly { // only Step's wait for the reductions can see it
				fc.calls, fc.only = new(int), new(int)
			}
			e, err := New(Config{Stage: stage, BucketBytes: 1024, Overlap: c.overlap, Offload: OffloadPolicy{Optimizer: c.offload}}, fc, params)
			if err != nil {
				t.Fatal(err)
			}
			if c.lastOnly {
				*fc.only = len(e.Plan().Buckets)
			}
			s := NewHostStream()
			if err := backward(e, s, constGrads(params, 1)); err != nil && !errors.Is(err, boom) {
				t.Fatal(err)
			}
			if err := e.Step(); !errors.Is(err, boom) {
				t.Errorf("%s: Step after a failed reduction: %v, want it", what, err)
			}
			if _, err := e.GradShard(); !errors.Is(err, ErrCollective) {
				t.Errorf("%s: GradShard after the failure: %v, want ErrCollective", what, err)
			}
			var host *hostMemory
			if e.off != nil {
				host = e.off.mem
			}
			e.Close()
			s.Close()
			if host != nil && host.bytes != 0 {
				t.Errorf("%s: %d host bytes left after Close", what, host.bytes)
			}
		}
	}
	// With an optimizer the failed reduction must stop Step before the
	// optimizer pass: master, moments, step counts and parameters unchanged.
	for _, stage := range []int{1, 2, 3} {
		for _, c := range []struct{ overlap, offload bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
			what := fmt.Sprintf("optimizer, stage %d overlap=%v offload=%v", stage, c.overlap, c.offload)
			comms, _ := NewLocalGroup(1)
			ps, bufs := smallModel(FP32, 0.5)
			e, err := New(Config{Stage: stage, BucketBytes: 512, Overlap: c.overlap, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.1)}}, Offload: OffloadPolicy{Optimizer: c.offload}}, faultyComm{Comm: comms[0], err: boom}, ps)
			if err != nil {
				t.Fatal(err)
			}
			s := NewHostStream()
			before := snapshotState(e, bufs)
			if err := backward(e, s, constGrads(ps[:3], 1)); err != nil && !errors.Is(err, boom) {
				t.Fatal(err)
			}
			if err := e.Step(); !errors.Is(err, boom) {
				t.Errorf("%s: Step after a failed reduction: %v, want it", what, err)
			}
			if after := snapshotState(e, bufs); !after.equal(before) {
				t.Errorf("%s: the failed step changed the master, moments, steps or parameters", what)
			}
			e.Close()
			s.Close()
		}
	}
}

// TestEngineFailsOnPeerLoss: a rank that leaves mid-step makes the other
// rank's Step fail with the cause, never hang: ErrPeerFailed when it
// closed its communicator, ErrTimeout when it vanished.
func TestEngineFailsOnPeerLoss(t *testing.T) {
	params := []Param{{Count: 1000, DType: FP32}, {Count: 3000, DType: FP32}}
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{false, true} {
			for _, closes := range []bool{true, false} {
				timeout, want := 20*time.Second, ErrPeerFailed
				if !closes {
					timeout, want = 300*time.Millisecond, ErrTimeout
				}
				comms, _ := NewLocalGroupTimeout(2, timeout)
				reported := make(chan struct{})
				errs := eachRank(2, func(r int) error {
					e, err := New(Config{Stage: stage, BucketBytes: 4096, Overlap: overlap}, comms[r], params)
					if err != nil {
						return err
					}
					defer e.Close()
					if r == 1 {
						<-reported // leaves while rank 0's reductions wait for it
						if closes {
							comms[1].Close()
						}
						return nil
					}
					s := NewHostStream()
					defer s.Close()
					err = backward(e, s, constGrads(params, 1))
					close(reported)
					if err != nil {
						return err
					}
					return e.Step()
				})
				if !errors.Is(errs[0], want) {
					t.Errorf("stage %d overlap=%v closes=%v: rank 0: %v, want %v", stage, overlap, closes, errs[0], want)
				}
			}
		}
	}
}

// TestCloseWaitsAndFreesEverything: Close while a gradient is still being
// read into a half-filled bucket, or a full bucket's reduction still waits
// for its gradient (their stream is held), waits for that work before
// freeing a buffer, and frees every buffer the engine allocated.
func TestCloseWaitsAndFreesEverything(t *testing.T) {
	// Bucket 0 holds parameter 2, bucket 1 parameters 1 and 0.
	params := []Param{{Count: 100, DType: FP32}, {Count: 100, DType: FP32}, {Count: 1000, DType: FP32}}
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{false, true} {
			for _, report := range [][]int{{1}, {2}, {2, 1}} {
				where := fmt.Sprintf("stage %d overlap=%v reported %v", stage, overlap, report)
				dev := newCountingDevice()
				comms, _ := NewLocalGroup(1)
				e, err := New(Config{Stage: stage, BucketBytes: 1024, Overlap: overlap}, onDevice{comms[0], dev}, params)
				if err != nil {
					t.Fatal(err)
				}
				s, open := gateStream()
				var pending []Event // what must have run before any free
				for _, p := range report {
					ev, err := e.GradReady(p, constGrads(params, 1)[p], s)
					if err != nil {
						t.Fatal(err)
					}
					pending = append(pending, ev)
				}
				for _, done := range e.pl.reducing {
					pending = append(pending, done)
				}
				var early atomic.Bool
				dev.onFree = func(Tensor) {
					for _, ev := range pending {
						if !ev.Done() {
							early.Store(true)
						}
					}
				}
				closed := make(chan error)
				frees, blocked := dev.frees.Load(), hostSyncsBlocked.Load() // New freed a scratch buffer
				go func() { closed <- e.Close() }()
				// Open the gate once Close waits on an event, or once it has
				// freed something without waiting.
				for hostSyncsBlocked.Load() == blocked && dev.frees.Load() == frees {
					time.Sleep(50 * time.Microsecond)
				}
				open()
				if err := <-closed; err != nil {
					t.Fatal(err)
				}
				if early.Load() {
					t.Errorf("%s: Close freed a buffer before the work that uses it had run", where)
				}
				if n := dev.liveBytes(); n != 0 {
					t.Errorf("%s: %d bytes still allocated after Close", where, n)
				}
				s.Close()
				dev.release()
			}
		}
	}
}

// TestStatsCountOnlyTheEngine: a caller's collectives on the engine's
// communicator, in the middle of a backward, do not show in the stats.
func TestStatsCountOnlyTheEngine(t *testing.T) {
	params := testParams(FP32)
	stats := make([]Stats, 2)
	comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
	errs := eachRank(2, func(rank int) error {
		e, err := New(Config{Stage: 2, BucketBytes: 1 << 20, Overlap: true}, comms[rank], params)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		mine := Float32s(make([]float32, 1000))
		grads := constGrads(params, 1)
		for p := len(params) - 1; p >= 0; p-- {
			if _, err := e.GradReady(p, grads[p], s); err != nil {
				return err
			}
			if err := comms[rank].AllReduce(s, mine, OpSum); err != nil {
				return err
			}
		}
		if err := e.EndBackward(); err != nil {
			return err
		}
		if err := e.Step(); err != nil {
			return err
		}
		stats[rank] = e.Stats()
		return nil
	})
	everyRankIs(t, "run", errs, nil)
	for rank, st := range stats {
		if got := st.Collectives[KindAllReduce].Calls; got != 1 {
			t.Errorf("rank %d: %d all-reduces in the stats; the engine made 1 (its window check), the caller %d", rank, got, len(params))
		}
		if got := st.Collectives[KindReduceScatter].Calls; got != 1 {
			t.Errorf("rank %d: %d reduce-scatters, want 1 (one bucket)", rank, got)
		}
	}
}

// TestPeakResetsAtStep: the peak is over the window. A window whose
// gradients arrive in registration order grows the staging pool to a
// buffer per bucket; after TrimPools the next window but one peaks at the
// shard and two buffers again. Expected bytes are worked out by hand.
func TestPeakResetsAtStep(t *testing.T) {
	// testParams(FP32) cut at 256 bytes on 1 rank: 7 buckets of 1, 513, 64,
	// 129, 1000, 7 and 300 elements, padded to 64: 64, 576, 64, 192, 1024,
	// 64, 320 (2304 elements of fp32 shard, 9216 bytes); a staging buffer
	// holds the largest bucket, 1024 fp32 elements, 4096 bytes.
	const shard, staging = 9216, 4096
	params := testParams(FP32)
	comms, _ := NewLocalGroup(1)
	e, err := New(Config{Stage: 2, BucketBytes: 256}, comms[0], params)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	grads := constGrads(params, 1)
	step := func(order []int) Stats {
		t.Helper()
		for _, p := range order {
			if _, err := e.GradReady(p, grads[p], s); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.EndBackward(); err != nil {
			t.Fatal(err)
		}
		if err := e.Step(); err != nil {
			t.Fatal(err)
		}
		return e.Stats()
	}
	registration, backwardOrder := []int{0, 1, 2, 3, 4, 5, 6, 7}, []int{7, 6, 5, 4, 3, 2, 1, 0}
	for i, tc := range []struct {
		order          []int
		trimBefore     bool
		buffers        int
		peak, resident int64
	}{
		{registration, false, 7, shard + 7*staging, shard + 7*staging},
		{backwardOrder, true, 2, shard + 7*staging, shard + 2*staging}, // held 7 until the trim
		{backwardOrder, false, 2, shard + 2*staging, shard + 2*staging},
	} {
		if tc.trimBefore {
			if err := e.TrimPools(); err != nil {
				t.Fatal(err)
			}
		}
		st := step(tc.order)
		if st.StagingBuffers != tc.buffers || st.PeakGradBytes != tc.peak || st.ResidentGradBytes != tc.resident {
			t.Errorf("window %d: %d staging buffers, peak %d, resident %d bytes; want %d, %d, %d", i, st.StagingBuffers, st.PeakGradBytes, st.ResidentGradBytes, tc.buffers, tc.peak, tc.resident)
		}
	}
}

// TestSumReduction: Reduction Sum leaves Σ_ranks Σ_backwards grad, with
// any PredivideFactor, in every stage.
func TestSumReduction(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	for _, stage := range []int{1, 2, 3} {
		for _, d := range []DType{FP32, BF16, FP16} {
			for _, world := range []int{3, 4} {
				params := testParams(d)
				r := runSpec{stage: stage, world: world, dtype: d, backwards: 3, steps: 2, streams: 2, bucket: 512, predivide: float64(world), overlap: stage != 2, reduction: Sum}
				data := makeWorkload(rng, r, params)
				checkMean(t, r, params, data, runEngine(t, r, params, data, seed))
			}
		}
	}
}

// TestMeanIsScaledSum: where W·G is a power of two, the mean has exactly
// the bits of the sum times 1/(W·G): the 1/W on the wire and the 1/G at
// the read are exact (fp16's subnormal range aside, so fp32 and bf16).
func TestMeanIsScaledSum(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	for _, stage := range []int{1, 2, 3} {
		for _, d := range []DType{FP32, BF16} {
			params := testParams(d)
			r := runSpec{stage: stage, world: 4, dtype: d, backwards: 2, steps: 2, streams: 2, bucket: 512, predivide: 1, overlap: true}
			data := makeWorkload(rng, r, params)
			mean := runEngine(t, r, params, data, seed)
			r.reduction = Sum
			sum := runEngine(t, r, params, data, seed)
			for rank := range mean {
				for step := range r.steps {
					for p := range params {
						for i, m := range mean[rank].full[step][p] {
							want := sum[rank].full[step][p][i] / 8
							if math.Float32bits(m) != math.Float32bits(want) {
								t.Fatalf("stage %d %v rank %d step %d: param %d[%d] mean %x, sum/8 %x", stage, d, rank, step, p, i, math.Float32bits(m), math.Float32bits(want))
							}
						}
					}
				}
			}
		}
	}
}

// TestGradViews: each parameter's view on each rank reads exactly its
// elements of the full gradient, the views of all ranks tile every
// parameter, and a write reads back (exactly, as G is a power of two
// here) and shows in GradShard at the plan's place.
func TestGradViews(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	for _, stage := range []int{1, 2, 3} {
		for _, world := range []int{1, 3, 4} {
			params := testParams(FP32)
			r := runSpec{stage: stage, world: world, dtype: FP32, backwards: 2, steps: 1, bucket: 700, predivide: 1}
			data := makeWorkload(rng, r, params)
			covered := make([][]int, len(params))
			for p, q := range params {
				covered[p] = make([]int, q.Count)
			}
			var mu sync.Mutex
			errs := onEngines(world, 20*time.Second, Config{Stage: stage, BucketBytes: r.bucket}, params, func(e *Engine, s *HostStream) error {
				for k := range r.backwards {
					grads := make([]Tensor, len(params))
					for p := range params {
						grads[p] = data[0][k][e.Rank()][p].t
					}
					if err := backward(e, s, grads); err != nil {
						return err
					}
				}
				if err := e.Step(); err != nil {
					return err
				}
				full, err := e.FullGrads()
				if err != nil {
					return err
				}
				for p := range params {
					v, err := e.GradView(p)
					if err != nil {
						return err
					}
					got := make([]float32, v.Count)
					if err := v.Read(got); err != nil {
						return err
					}
					for i, x := range got {
						if want := full[p][v.ParamOffset+i]; math.Float32bits(x) != math.Float32bits(want) {
							return fmt.Errorf("param %d view [%d] = %g, full gradient has %g", p, v.ParamOffset+i, x, want)
						}
					}
					mu.Lock()
					for i := range v.Count {
						covered[p][v.ParamOffset+i]++
					}
					mu.Unlock()
					for i := range got {
						got[i] = float32(p) + float32(i)/8
					}
					if err := v.Write(got); err != nil {
						return err
					}
					back := make([]float32, v.Count)
					if err := v.Read(back); err != nil {
						return err
					}
					shard, err := e.GradShard()
					if err != nil {
						return err
					}
					for i := range got {
						if back[i] != got[i] || shard[v.ShardOffset+i] != got[i] {
							return fmt.Errorf("param %d: wrote %g at %d, read back %g, shard has %g", p, got[i], i, back[i], shard[v.ShardOffset+i])
						}
					}
				}
				if err := (View{}).Read(nil); !errors.Is(err, ErrParam) {
					return fmt.Errorf("zero View: %v, want ErrParam", err)
				}
				if _, err := e.GradView(len(params)); !errors.Is(err, ErrParam) {
					return fmt.Errorf("GradView out of range: %v, want ErrParam", err)
				}
				if v, _ := e.GradView(2); v.Count > 0 {
					if err := v.Read(make([]float32, v.Count+1)); !errors.Is(err, ErrGradSize) {
						return fmt.Errorf("Read of the wrong length: %v, want ErrGradSize", err)
					}
				}
				return nil
			})
			everyRankIs(t, fmt.Sprintf("stage %d world %d", stage, world), errs, nil)
			for p := range covered {
				for i, n := range covered[p] {
					if n != 1 {
						t.Fatalf("stage %d world %d: param %d[%d] in %d ranks' views, want 1", stage, world, p, i, n)
					}
				}
			}
		}
	}
}

// doneCounter counts the reduce-scatters that have finished running, on
// the stream they ran on.
type doneCounter struct {
	Comm
	done atomic.Int32
}

func (c *doneCounter) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	if err := c.Comm.ReduceScatter(s, send, recv, op); err != nil {
		return err
	}
	return s.(*HostStream).Launch(func() error { c.done.Add(1); return nil })
}

// TestReductionsRunDuringBackward: once bucket 0's gradient is in, its
// reduce-scatter runs to completion while the gradient of bucket 1 is still
// held back by a gate, before EndBackward: at stages 2 and 3 every backward,
// at stage 1 in the backward flagged as the boundary.
func TestReductionsRunDuringBackward(t *testing.T) {
	// Bucket 0 holds parameter 1, bucket 1 parameter 0.
	params := []Param{{Count: 2048, DType: FP32}, {Count: 2048, DType: FP32}}
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{true, false} {
			where := fmt.Sprintf("stage %d overlap=%v", stage, overlap)
			comms, _ := NewLocalGroup(1)
			comm := &doneCounter{Comm: comms[0]}
			e, err := New(Config{Stage: stage, BucketBytes: 8192, Overlap: overlap}, comm, params)
			if err != nil {
				t.Fatal(err)
			}
			grads := constGrads(params, 1)
			free := NewHostStream()
			held, open := gateStream()
			e.SetBoundary(true) // ZeRO-1 reduces in this backward; the others always do
			if _, err := e.GradReady(1, grads[1], free); err != nil {
				t.Fatal(err)
			}
			if _, err := e.GradReady(0, grads[0], held); err != nil {
				t.Fatal(err)
			}
			settle(t, e.reduceStream, free)
			if got := comm.done.Load(); got != 1 {
				t.Errorf("%s: %d reduce-scatters done while bucket 1's gradient is held, want bucket 0's", where, got)
			}
			open()
			if err := e.EndBackward(); err != nil {
				t.Fatal(err)
			}
			if err := e.Step(); err != nil {
				t.Fatal(err)
			}
			if got := comm.done.Load(); got != 2 {
				t.Errorf("%s: %d reduce-scatters done after Step, want 2", where, got)
			}
			e.Close()
			free.Close()
			held.Close()
		}
	}
}

// abortingComm is a communicator whose collectives are aborted while they
// run, as NCCL's watchdog aborts a communicator: the reduce-scatter's work
// still completes on the stream (its event fires), and only the
// communicator knows it failed.
type abortingComm struct {
	Comm
	after   int // reduce-scatters that succeed before the abort
	calls   int
	aborted atomic.Pointer[error]
}

func (c *abortingComm) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	if err := c.Comm.ReduceScatter(s, send, recv, op); err != nil {
		return err
	}
	if c.calls++; c.calls > c.after {
		err := fmt.Errorf("%w: the watchdog aborted the communicator during reduce-scatter %d", ErrCollective, c.calls)
		c.aborted.CompareAndSwap(nil, &err)
	}
	return nil
}

func (c *abortingComm) asyncErr() error {
	if p := c.aborted.Load(); p != nil {
		return *p
	}
	return nil
}

// TestAbortedReductionFailsStep: a reduction whose communicator was aborted
// mid-collective fails Step (and the reads after it), though its event fired.
func TestAbortedReductionFailsStep(t *testing.T) {
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{false, true} {
			comms, _ := NewLocalGroup(1)
			c := &abortingComm{Comm: comms[0], after: 2}
			e, err := New(Config{Stage: stage, BucketBytes: 1024, Overlap: overlap}, c, params)
			if err != nil {
				t.Fatal(err)
			}
			s := NewHostStream()
			if err := backward(e, s, constGrads(params, 1)); err != nil {
				t.Fatal(err)
			}
			if err := e.Step(); !errors.Is(err, ErrCollective) {
				t.Errorf("stage %d overlap=%v: Step after an aborted reduction: %v, want the abort", stage, overlap, err)
			}
			if _, err := e.FullGrads(); err == nil {
				t.Errorf("stage %d overlap=%v: FullGrads after an aborted reduction returned a gradient", stage, overlap)
			}
			e.Close()
			s.Close()
		}
	}
}

// TestCloseAfterAFailedReduction: a reduction that fails part-way on the
// framework's stream (no overlap), at every device call it makes, leaves
// work queued there that uses the engine's buffers; Close waits for that
// work before freeing them, and frees everything.
func TestCloseAfterAFailedReduction(t *testing.T) {
	params := []Param{{Count: 100, DType: FP32}, {Count: 100, DType: FP32}, {Count: 1000, DType: FP32}}
	calls := -1 // the reference run counts the calls
	for n := 0; n <= calls || calls < 0; n++ {
		counting := newCountingDevice()
		dev := &failingDevice{Device: counting, failAt: n}
		comms, _ := NewLocalGroup(1)
		e, err := New(Config{Stage: 2, BucketBytes: 1024}, onDevice{comms[0], dev}, params)
		if err != nil {
			t.Fatal(err)
		}
		s, open := gateStream()
		base, err := s.Record()
		if err != nil {
			t.Fatal(err)
		}
		dev.armed = true
		_, err = e.GradReady(2, constGrads(params, 1)[2], s) // fills bucket 0: its reduction runs on s
		dev.armed = false
		if n == 0 {
			calls = dev.calls
			if err != nil {
				t.Fatal(err)
			}
		} else if !errors.Is(err, errInjected) {
			t.Fatalf("call %d of %d failing: GradReady returned %v", n, calls, err)
		}
		pending, err := s.Record()
		if err != nil {
			t.Fatal(err)
		}
		// only what the engine enqueued (between the two records) counts
		enqueued := pending.(*hostEvent).seq > base.(*hostEvent).seq+1
		var early atomic.Bool
		counting.onFree = func(x Tensor) {
			if enqueued && dev.uses(x) && !pending.Done() {
				early.Store(true)
			}
		}
		closed := make(chan error)
		frees := counting.frees.Load()
		go func() { closed <- e.Close() }()
		// Open the gate once Close waits for the gated work, or once it has
		// freed something without waiting.
		for !s.waitedOn() && counting.frees.Load() == frees {
			time.Sleep(50 * time.Microsecond)
		}
		open()
		<-closed
		if early.Load() {
			t.Errorf("call %d of %d failing: Close freed a buffer before the work queued on the stream had run", n, calls)
		}
		if b := counting.liveBytes(); b != 0 {
			t.Errorf("call %d of %d failing: %d bytes still allocated after Close", n, calls, b)
		}
		s.Close()
		counting.release()
	}
}

// TestRankWithoutGradients: a rank that hands over no gradient in a
// backward still takes part in every reduction, so every rank's Step
// succeeds with the mean (the silent rank counts as zeros), at every stage,
// in a coalesced window, with NoSync, and with a boundary. The group's
// timeout is short: a rank that skipped a collective shows as a timeout.
func TestRankWithoutGradients(t *testing.T) {
	params := testParams(FP32)
	ones := constGrads(params, 1)
	for _, stage := range []int{1, 2, 3} {
		for _, mode := range []string{"plain", "boundary", "coalesce", "nosync"} {
			// rank 1 reports nothing in the last backward, or in the whole step
			for _, wholeStep := range []bool{false, true} {
				name := fmt.Sprintf("stage %d %s whole step %v", stage, mode, wholeStep)
				want := float32(0.75) // 3 backwards of ones over 2 ranks × 2 backwards
				if wholeStep {
					want = 0.5
				}
				cfg := Config{Stage: stage, BucketBytes: 1024, Overlap: true}
				errs := onEngines(2, 2*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
					take := func(k int, boundary bool) error {
						if boundary {
							e.SetBoundary(true)
						}
						if e.Rank() == 1 && (k == 1 || wholeStep) {
							return e.EndBackward()
						}
						return backward(e, s, ones)
					}
					var err error
					switch mode {
					case "plain", "boundary":
						if err = take(0, false); err == nil {
							err = take(1, mode == "boundary")
						}
					case "coalesce":
						err = e.Coalesce(func() error {
							if err := take(0, false); err != nil {
								return err
							}
							return take(1, false)
						})
					case "nosync":
						if err = e.NoSync(func() error { return take(0, false) }); err == nil {
							err = take(1, false)
						}
					}
					if err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					full, err := e.FullGrads()
					if err != nil {
						return err
					}
					return wantAll(full, want)
				})
				everyRankIs(t, name, errs, nil)
			}
		}
	}
}

// TestBoundaryInsideABackward: SetBoundary(true) after a backward's first
// gradient, or inside a window, changes no result and loses nothing: the
// backward's local buckets are reduced at the next flush, and a window's
// buckets once each.
func TestBoundaryInsideABackward(t *testing.T) {
	params := testParams(FP32)
	for _, stage := range []int{1, 2} {
		for _, window := range []bool{false, true} {
			cfg := Config{Stage: stage, BucketBytes: 1024}
			errs := onEngines(2, 5*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
				if window {
					if err := e.BeginCoalesce(); err != nil {
						return err
					}
				}
				grads := constGrads(params, 2)
				for i, p := 0, len(params)-1; p >= 0; i, p = i+1, p-1 {
					if i == 1 {
						e.SetBoundary(true)
					}
					if _, err := e.GradReady(p, grads[p], s); err != nil {
						return err
					}
				}
				if err := e.EndBackward(); err != nil {
					return err
				}
				if window {
					if err := e.EndCoalesce(); err != nil {
						return err
					}
				}
				if err := e.Step(); err != nil {
					return err
				}
				if rs, want := e.Stats().Collectives[KindReduceScatter].Calls, int64(len(e.Plan().Buckets)); rs != want {
					return fmt.Errorf("%d reduce-scatters, want one per bucket (%d)", rs, want)
				}
				full, err := e.FullGrads()
				if err != nil {
					return err
				}
				return wantAll(full, 2)
			})
			everyRankIs(t, fmt.Sprintf("stage %d window %v", stage, window), errs, nil)
		}
	}
}

// TestAbortFreesEveryRank: Abort from another goroutine, while rank 0 is
// blocked in Step waiting for rank 1 (which is busy elsewhere) and the
// group's timeout is the default five minutes, makes rank 0's Step return
// within a second (ErrAborted and ErrCollective, not ErrPeerFailed: the
// abort is its own), and rank 1's next collective fail at once
// (ErrPeerFailed), on every stage.
func TestAbortFreesEveryRank(t *testing.T) {
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		comms, _ := NewLocalGroup(2) // the default timeout: five minutes
		var e0 *Engine
		ready := make(chan struct{})
		var results [2]error
		var took [2]time.Duration
		var wg sync.WaitGroup
		rank1 := make(chan struct{})
		for r := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				e, err := New(Config{Stage: stage, BucketBytes: 1024}, comms[r], params)
				if err != nil {
					results[r] = err
					if r == 0 {
						close(ready)
					}
					return
				}
				defer e.Close()
				s := NewHostStream()
				defer s.Close()
				if err := backward(e, s, constGrads(params, 1)); err != nil {
					results[r] = err
					return
				}
				if r == 0 {
					e0 = e
					close(ready)
				} else {
					<-rank1 // busy elsewhere until rank 0 was aborted
				}
				start := time.Now()
				results[r] = e.Step()
				took[r] = time.Since(start)
			}()
		}
		<-ready
		time.Sleep(50 * time.Millisecond) // rank 0 is blocked in Step by now
		e0.Abort(errors.New("the trainer gives up"))
		time.Sleep(50 * time.Millisecond)
		close(rank1)
		wg.Wait()
		if !errors.Is(results[0], ErrAborted) || !errors.Is(results[0], ErrCollective) || errors.Is(results[0], ErrPeerFailed) || took[0] > time.Second+100*time.Millisecond {
			t.Errorf("stage %d: rank 0's Step returned %v after %v; want ErrAborted and ErrCollective (not ErrPeerFailed) within a second", stage, results[0], took[0])
		}
		if !errors.Is(results[1], ErrPeerFailed) || took[1] > time.Second {
			t.Errorf("stage %d: rank 1's Step returned %v after %v; want ErrPeerFailed at once", stage, results[1], took[1])
		}
	}
}
