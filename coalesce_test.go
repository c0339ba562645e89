package zero

import (
	"errors"
	"fmt"
	mrand "math/rand"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestCoalesceEqualsZeRO1: a coalesced window gives ZeRO-1's bits on the
// same inputs (the same arithmetic: a local fp32 sum, then one reduction),
// at stages 1, 2 and 3, with and without Overlap, tiny and default
// buckets, every dtype, windows in every step or in every other; NoSync
// at stages 2 and 3 equals the window bit for bit. Per-backward reduction
// (no window) agrees within checkMean's bound.
func TestCoalesceEqualsZeRO1(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(uint64(seed), 7))
	for _, dt := range allDTypes {
		params := testParams(dt)
		for _, bucket := range []int{64, 32 << 20} {
			for _, every := range []bool{true, false} {
				base := runSpec{stage: 1, world: 3, dtype: dt, bucket: bucket, backwards: 3, steps: 3, streams: 2, predivide: 1, windowEvery: every}
				data := makeWorkload(mrand.New(mrand.NewSource(rng.Int64())), base, params)
				want := runEngine(t, base, params, data, seed)
				for _, stage := range []int{1, 2, 3} {
					for _, overlap := range []bool{false, true} {
						r := base
						r.stage, r.overlap, r.window = stage, overlap, "coalesce"
						got := runEngine(t, r, params, data, seed)
						if every || stage == 1 {
							if err := sameShards(want, got); err != nil {
								t.Fatalf("%v coalesce every=%v: %v", r, every, err)
							}
						} else {
							checkMean(t, r, params, data, got) // windows in some steps only
						}
						if stage > 1 {
							r.window = "nosync"
							ns := runEngine(t, r, params, data, seed)
							if err := sameShards(got, ns); err != nil {
								t.Fatalf("%v nosync: %v", r, err)
							}
						}
						r.window = ""
						checkMean(t, r, params, data, runEngine(t, r, params, data, seed))
					}
				}
			}
		}
	}
}

// TestCoalesceCollectiveCounts: N = 4 backwards in a window make exactly
// one reduce-scatter per bucket, where ZeRO-2 and ZeRO-3 make N; with a
// budget, (local buckets) + N × (streamed buckets), the same on every rank
// whatever the arrival order, and within checkMean's bound of the
// unbudgeted window.
func TestCoalesceCollectiveCounts(t *testing.T) {
	seed := testSeed(t)
	params := testParams(BF16)
	const n = 4
	base := runSpec{stage: 2, world: 2, dtype: BF16, bucket: 512, backwards: n, steps: 2, streams: 2, predivide: 1, windowEvery: true, shuffle: true}
	data := makeWorkload(mrand.New(mrand.NewSource(seed)), base, params)
	for _, stage := range []int{2, 3} {
		r := base
		r.stage = stage
		plain := runEngine(t, r, params, data, seed)
		buckets := int64(len(plain[0].plan.Buckets))
		if got := plain[0].stats[1].Collectives[KindReduceScatter].Calls; got != n*buckets {
			t.Errorf("stage %d without a window: %d reduce-scatters, want %d × %d buckets", stage, got, n, buckets)
		}
		r.window = "coalesce"
		whole := runEngine(t, r, params, data, seed)
		if got := whole[0].stats[1].Collectives[KindReduceScatter].Calls; got != buckets {
			t.Errorf("stage %d window: %d reduce-scatters, want one per bucket (%d)", stage, got, buckets)
		}
		// a budget of about half the accumulators
		plan := whole[0].plan
		total := 0
		for _, b := range plan.Buckets {
			total += 4 * b.Elems
		}
		r.budget = total / 2
		budgeted := runEngine(t, r, params, data, seed)
		local := 0
		used := 0
		for b := len(plan.Buckets) - 1; b >= 0 && used+4*plan.Buckets[b].Elems <= r.budget; b-- {
			used += 4 * plan.Buckets[b].Elems
			local++
		}
		if local == 0 || local == len(plan.Buckets) {
			t.Fatalf("budget %d makes %d of %d buckets local; the test wants some of each", r.budget, local, len(plan.Buckets))
		}
		want := int64(local + n*(len(plan.Buckets)-local))
		for rank := range budgeted {
			if got := budgeted[rank].stats[1].Collectives[KindReduceScatter].Calls; got != want {
				t.Errorf("stage %d budget %d rank %d: %d reduce-scatters, want %d local + %d × %d streamed", stage, r.budget, rank, got, local, n, len(plan.Buckets)-local)
			}
			if st := budgeted[rank].stats[1]; st.WindowResidentBytes-int64(plan.ShardElems*4) > int64(r.budget)+int64(st.StagingBuffers*plan.MaxBucket()*2) {
				t.Errorf("stage %d rank %d: %d bytes resident in the window, over shard + budget %d + staging", stage, rank, st.WindowResidentBytes, r.budget)
			}
		}
		checkMean(t, r, params, data, budgeted)
	}
}

// TestCoalesceErrors: Step inside a window, a window inside a window,
// NoSync inside Coalesce and Coalesce inside NoSync are ErrProtocol and
// change nothing: the window goes on and the step's result is the one
// without the refused calls.
func TestCoalesceErrors(t *testing.T) {
	params := []Param{{Count: 100, DType: FP32}, {Count: 50, DType: FP32}}
	comms, _ := NewLocalGroup(1)
	e, err := New(Config{Stage: 2, BucketBytes: 256}, comms[0], params)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	backward := func() {
		for p := 1; p >= 0; p-- {
			if _, err := e.GradReady(p, constGrads(params, 2)[p], s); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.EndBackward(); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.EndCoalesce(); !errors.Is(err, ErrProtocol) {
		t.Errorf("EndCoalesce without a window: %v", err)
	}
	if err := e.BeginCoalesce(); err != nil {
		t.Fatal(err)
	}
	backward()
	for name, call := range map[string]func() error{
		"Step":          e.Step,
		"BeginCoalesce": e.BeginCoalesce,
		"BeginNoSync":   e.BeginNoSync,
		"EndNoSync":     e.EndNoSync,
	} {
		if err := call(); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s inside a window: %v, want ErrProtocol", name, err)
		}
	}
	backward()
	if err := e.EndCoalesce(); err != nil {
		t.Fatal(err)
	}
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.Backwards != 2 || st.Collectives[KindReduceScatter].Calls != int64(len(e.Plan().Buckets)) {
		t.Errorf("after the refused calls: %d backwards and %d reduce-scatters, want 2 and one per bucket", st.Backwards, st.Collectives[KindReduceScatter].Calls)
	}
	checkFull(t, e, 2)
	if err := e.BeginNoSync(); err != nil {
		t.Fatal(err)
	}
	if err := e.BeginCoalesce(); !errors.Is(err, ErrProtocol) {
		t.Errorf("Coalesce inside NoSync: %v", err)
	}
	if err := e.Step(); !errors.Is(err, ErrProtocol) {
		t.Errorf("Step inside NoSync: %v", err)
	}
	backward()
	if err := e.EndNoSync(); err != nil {
		t.Fatal(err)
	}
	backward() // reduces both
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.Collectives[KindReduceScatter].Calls != int64(len(e.Plan().Buckets)) {
		t.Errorf("NoSync then a backward: %d reduce-scatters, want one per bucket", st.Collectives[KindReduceScatter].Calls)
	}
	checkFull(t, e, 2)
}

// checkFull wants every element of the mean gradient to be want.
func checkFull(t *testing.T, e *Engine, want float32) {
	t.Helper()
	full, err := e.FullGrads()
	if err != nil {
		t.Fatal(err)
	}
	if err := wantAll(full, want); err != nil {
		t.Error(err)
	}
}

// TestCoalesceWindowDType: a window whose local sums are in the model dtype
// (bf16, fp16) rounds each backward's sum as a framework's .grad does: the
// result is within checkMean's bound (which counts a rounding to the model
// dtype per backward), at stages 2 and 3 with and without Overlap, tiny and
// default buckets, and the window holds half the accumulator bytes of an
// fp32 window; at stage 1 too, whose own sums follow Window.DType.
func TestCoalesceWindowDType(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(uint64(seed), 9))
	for _, dt := range []DType{BF16, FP16} {
		params := testParams(dt)
		base := runSpec{stage: 2, world: 2, dtype: dt, bucket: 512, backwards: 4, steps: 2, streams: 2, predivide: 1,
			window: "coalesce", windowEvery: true}
		data := makeWorkload(mrand.New(mrand.NewSource(rng.Int64())), base, params)
		for _, stage := range []int{1, 2, 3} {
			for _, v := range []struct {
				overlap bool
				bucket  int
			}{{false, 512}, {true, 512}, {true, 64}, {false, 32 << 20}} {
				if stage == 1 && v.bucket != 512 {
					continue
				}
				r := base
				r.stage, r.overlap, r.bucket = stage, v.overlap, v.bucket
				wide := runEngine(t, r, params, data, seed)
				r.windowDType = dt
				narrow := runEngine(t, r, params, data, seed)
				checkMean(t, r, params, data, narrow)
				// fp32 sums hold the padded elements (ZeRO-1's own, the
				// elements only); 16-bit ones the padded elements, 2 bytes each
				want := int64(0)
				for _, b := range narrow[0].plan.Buckets {
					want += int64(4*b.Padded - 2*b.Padded)
					if stage == 1 {
						want += int64(4*b.Elems - 4*b.Padded)
					}
				}
				w, n := wide[0].stats[1].WindowResidentBytes, narrow[0].stats[1].WindowResidentBytes
				if saved := w - n; saved != want {
					t.Errorf("%v: the window holds %d bytes in %v, %d in fp32; want %d less", r, n, dt, w, want)
				}
			}
		}
	}
}

// TestWindowMemory: the gradient memory of a coalesced window, to the
// byte, from the plan: the fp32 shard, the staging buffers (comm dtype),
// the local sums of the buckets the window makes local (in WindowDType;
// under a budget only the last-produced buckets that fit, counted in that
// dtype). WindowResidentBytes
// holds it at the window's end; after Step every buffer but the shard is
// idle in the pools (PooledGradBytes).
func TestWindowMemory(t *testing.T) {
	seed := testSeed(t)
	params := testParams(BF16)
	const n = 3
	base := runSpec{stage: 2, world: 2, dtype: BF16, bucket: 512, backwards: n, steps: 2, streams: 2, predivide: 1, window: "coalesce", windowEvery: true}
	data := makeWorkload(mrand.New(mrand.NewSource(seed)), base, params)
	for _, stage := range []int{2, 3} {
		for _, wdt := range []DType{FP32, BF16} {
			for _, half := range []bool{false, true} {
				r := base
				r.stage, r.windowDType = stage, wdt
				plan := newPlan(params, r.bucket, r.world, 64)
				size := wdt.Size()
				if half { // exactly the sums of the last half of the buckets
					for b := len(plan.Buckets) / 2; b < len(plan.Buckets); b++ {
						r.budget += size * plan.Buckets[b].Padded
					}
				}
				local, sums := 0, 0
				for b := len(plan.Buckets) - 1; b >= 0; b-- {
					if r.budget > 0 && sums+size*plan.Buckets[b].Padded > r.budget {
						break
					}
					sums += size * plan.Buckets[b].Padded
					local++
				}
				if half && (local == 0 || local == len(plan.Buckets)) {
					t.Fatalf("the budget makes %d of %d buckets local; the test wants some of each", local, len(plan.Buckets))
				}
				res := runEngine(t, r, params, data, seed)
				checkMean(t, r, params, data, res)
				for rank, rr := range res {
					st := rr.stats[1]
					staging := int64(st.StagingBuffers * plan.MaxBucket() * 2)
					shard := int64(plan.ShardElems * 4)
					what := fmt.Sprintf("stage %d window %v budget %d rank %d", stage, wdt, r.budget, rank)
					if want := shard + staging + int64(sums); st.WindowResidentBytes != want {
						t.Errorf("%s: %d bytes resident at the window's end, want %d (shard %d, staging %d, sums %d)", what, st.WindowResidentBytes, want, shard, staging, sums)
					}
					if st.PooledGradBytes != st.ResidentGradBytes-shard || st.ResidentGradBytes != st.WindowResidentBytes {
						t.Errorf("%s: after Step %d bytes resident, %d pooled; want the window's %d, all but the shard pooled", what, st.ResidentGradBytes, st.PooledGradBytes, st.WindowResidentBytes)
					}
					if want := int64(local + n*(len(plan.Buckets)-local)); st.Collectives[KindReduceScatter].Calls != want {
						t.Errorf("%s: %d reduce-scatters, want %d local + %d × %d streamed", what, st.Collectives[KindReduceScatter].Calls, local, n, len(plan.Buckets)-local)
					}
				}
			}
		}
	}
}

// TestCoalesceAfterNoSyncAndStep: a Step right after EndNoSync reduces what
// NoSync held and ends it: a window may open next.
func TestCoalesceAfterNoSyncAndStep(t *testing.T) {
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		errs := onEngines(2, 20*time.Second, Config{Stage: stage, BucketBytes: 1024}, params, func(e *Engine, s *HostStream) error {
			if err := e.NoSync(func() error { return backward(e, s, constGrads(params, 1)) }); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
			if err := e.Coalesce(func() error { return backward(e, s, constGrads(params, 3)) }); err != nil {
				return fmt.Errorf("a window after NoSync and Step: %w", err)
			}
			if err := e.Step(); err != nil {
				return err
			}
			full, err := e.FullGrads()
			if err != nil {
				return err
			}
			return wantAll(full, 3)
		})
		everyRankIs(t, fmt.Sprintf("stage %d", stage), errs, nil)
	}
}

// TestDiscardGrads: after a GradReady refused in the middle of a window's
// backward, DiscardGrads on every rank drops the window's gradients (the
// half backward with them) and the window goes on: the step's mean is over
// the backwards taken after it only, at every stage, streamed or local.
func TestDiscardGrads(t *testing.T) {
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		for _, window := range []bool{false, true} {
			cfg := Config{Stage: stage, BucketBytes: 1024, Overlap: true}
			errs := onEngines(2, 5*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
				if window {
					if err := e.BeginCoalesce(); err != nil {
						return err
					}
				}
				if err := backward(e, s, constGrads(params, 1)); err != nil {
					return err
				}
				ones := constGrads(params, 1)
				for p := len(params) - 1; p >= 4; p-- {
					if _, err := e.GradReady(p, ones[p], s); err != nil {
						return err
					}
				}
				if _, err := e.GradReady(2, Float32s(make([]float32, 3)), s); !errors.Is(err, ErrGradSize) {
					return fmt.Errorf("a gradient of the wrong size: %v, want ErrGradSize", err)
				}
				if err := e.DiscardGrads(); err != nil {
					return err
				}
				for range 2 {
					if err := backward(e, s, constGrads(params, 3)); err != nil {
						return err
					}
				}
				if window {
					if err := e.EndCoalesce(); err != nil {
						return err
					}
				}
				if err := e.Step(); err != nil {
					return err
				}
				if st := e.Stats(); st.Backwards != 2 {
					return fmt.Errorf("the step counted %d backwards, want the 2 after DiscardGrads", st.Backwards)
				}
				full, err := e.FullGrads()
				if err != nil {
					return err
				}
				return wantAll(full, 3)
			})
			everyRankIs(t, fmt.Sprintf("stage %d window %v", stage, window), errs, nil)
		}
	}
}

// TestWindowClosesOnError: Coalesce and NoSync whose fn fails close their
// window and drop its gradients (the shard reads nothing until the next
// Step); the next window opens and steps normally.
func TestWindowClosesOnError(t *testing.T) {
	params := testParams(FP32)
	boom := errors.New("the framework failed")
	for _, stage := range []int{1, 2, 3} {
		for _, kind := range []string{"coalesce", "nosync"} {
			cfg := Config{Stage: stage, BucketBytes: 1024}
			errs := onEngines(2, 5*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
				if err := backward(e, s, constGrads(params, 1)); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				run := e.Coalesce
				if kind == "nosync" {
					run = e.NoSync
				}
				failing := func() error {
					if err := backward(e, s, constGrads(params, 7)); err != nil {
						return err
					}
					if _, err := e.GradReady(7, constGrads(params, 7)[7], s); err != nil { // a backward left open
						return err
					}
					return boom
				}
				if err := run(failing); !errors.Is(err, boom) {
					return fmt.Errorf("%s(fn) whose fn fails: %v, want fn's error", kind, err)
				}
				if _, err := e.GradShard(); !errors.Is(err, ErrProtocol) {
					return fmt.Errorf("GradShard after the failed window: %v, want ErrProtocol", err)
				}
				if err := e.Coalesce(func() error { return backward(e, s, constGrads(params, 5)) }); err != nil {
					return fmt.Errorf("a window after the failed one: %w", err)
				}
				if err := e.Step(); err != nil {
					return err
				}
				full, err := e.FullGrads()
				if err != nil {
					return err
				}
				return wantAll(full, 5)
			})
			everyRankIs(t, fmt.Sprintf("stage %d %s", stage, kind), errs, nil)
		}
	}
}

// TestWindowSumsReusedClean: a window's pooled sums come back holding the
// last window's values; a member no rank reports in the next window must
// still reduce to zero, with sums reduced in place (comm dtype) or through
// a staging buffer (fp32 sums).
func TestWindowSumsReusedClean(t *testing.T) {
	params := []Param{{Name: "a", Count: 300, DType: BF16}, {Name: "b", Count: 77, DType: BF16}, {Name: "c", Count: 500, DType: BF16}}
	for _, wdt := range []DType{BF16, FP32} {
		cfg := Config{Stage: 2, BucketBytes: 1 << 20, Overlap: true}
		cfg.Window.DType = wdt
		full := make([][][]float32, 2)
		errs := onEngines(2, time.Minute, cfg, params, func(e *Engine, s *HostStream) error {
			grads := bf16Grads(params, 1)
			for step, skip := range []int{-1, 1} { // the second window leaves out b
				err := e.Coalesce(func() error {
					for range 2 {
						for p := len(params) - 1; p >= 0; p-- {
							if p == skip {
								continue
							}
							if _, err := e.GradReady(p, grads[p], s); err != nil {
								return err
							}
						}
						if err := e.EndBackward(); err != nil {
							return err
						}
					}
					return nil
				})
				if err == nil {
					err = e.Step()
				}
				if err != nil {
					return fmt.Errorf("step %d: %w", step, err)
				}
			}
			g, err := e.FullGrads()
			full[e.Rank()] = g
			return err
		})
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		for rank, g := range full {
			for p := range params {
				want := float32(1) // the mean of a window of 2 backwards of ones
				if p == 1 {
					want = 0
				}
				if err := wantAll(g[p:p+1], want); err != nil {
					t.Errorf("window sums %v, rank %d, %s: %v", wdt, rank, params[p].Name, err)
				}
			}
		}
	}
}

// TestLocalSumsInShard: where the local sums are in the shard's dtype and
// the comm dtype (bf16 throughout, DeepSpeed's choice), the buckets
// hostedSums picks keep their sums in the shard's own memory until their
// flush: the shard has the bits of the run with every sum in a buffer of
// its own, the optimizer's master weights too, and the window (or ZeRO-1's
// backwards) holds exactly those sums' bytes less. Eight equal buckets on
// two ranks: the sums of buckets 0, 2, 4 and 6 each cover their own part
// and the next bucket's, so those four fit; under a budget that streams
// buckets 0-2, bucket 2's sums would cover bucket 3's part, which streams.
func TestLocalSumsInShard(t *testing.T) {
	seed := testSeed(t)
	params := make([]Param, 8)
	for i := range params {
		params[i] = Param{Name: fmt.Sprint("p", i), Count: 4096, DType: BF16}
	}
	base := runSpec{world: 2, dtype: BF16, shard: BF16, windowDType: BF16, bucket: 8192, backwards: 3, steps: 2,
		streams: 2, overlap: true, predivide: 1, windowEvery: true}
	data := makeWorkload(mrand.New(mrand.NewSource(seed)), base, params)
	plan := newPlan(params, base.bucket, base.world, 64)
	if len(plan.Buckets) != 8 || plan.Buckets[0].Padded != 4096 {
		t.Fatalf("plan: %d buckets of %d elements; the test wants 8 of 4096", len(plan.Buckets), plan.Buckets[0].Padded)
	}
	for _, c := range []struct {
		stage   int
		window  string
		budget  int  // bytes of local sums; the rest stream
		overlap bool // off: each bucket reduces on the stream that completed it
	}{{1, "", 0, true}, {1, "", 0, false}, {1, "coalesce", 0, false}, {2, "coalesce", 0, true}, {2, "nosync", 0, false},
		{3, "coalesce", 0, true}, {2, "coalesce", 5 * 8192, true}} {
		r := base
		r.stage, r.window, r.budget, r.overlap = c.stage, c.window, c.budget, c.overlap
		hostSumsInShard = false
		own := runEngine(t, r, params, data, seed)
		hostSumsInShard = true
		hosted := runEngine(t, r, params, data, seed)
		if err := sameShards(own, hosted); err != nil {
			t.Fatalf("%v: %v", r, err)
		}
		for rank := range hosted {
			for st := range hosted[rank].stats {
				o, h := own[rank].stats[st], hosted[rank].stats[st]
				held, ownHeld := h.WindowResidentBytes, o.WindowResidentBytes
				if c.window == "" { // ZeRO-1's backwards: the step's peak
					held, ownHeld = h.PeakGradBytesInUse, o.PeakGradBytesInUse
				}
				// Under the budget buckets 3-7 are local: 4 and 6 are
				// hosted (3 and 5 cover a part of the next bucket's).
				hostedBytes := int64(4 * 4096 * 2)
				if c.budget > 0 {
					hostedBytes = 2 * 4096 * 2
				}
				if ownHeld-held != hostedBytes {
					t.Errorf("%v: rank %d step %d: %d bytes held, %d with the sums apart; want %d less", r, rank, st, held, ownHeld, hostedBytes)
				}
			}
		}
	}
	// With the optimizer: the last step's pass reads the shard that the
	// next step's first sums overwrite.
	d := makeNormData(seed)
	for _, stage := range []int{1, 2, 3} {
		for _, way := range normWays {
			hostSumsInShard = false
			own := runNormWayIn(t, d, stage, false, BF16, BF16, way, true)
			hostSumsInShard = true
			hosted := runNormWayIn(t, d, stage, false, BF16, BF16, way, true)
			for rank := range 2 {
				for st := range own.master[rank] {
					if !slices.Equal(own.master[rank][st], hosted.master[rank][st]) {
						t.Fatalf("stage %d %s: rank %d step %d: master weights differ with the sums in the shard", stage, way.name, rank, st)
					}
				}
			}
		}
	}
}

// slowHostedComm holds every other reduce-scatter back on its stream (the
// hosted buckets' under TestLocalSumsInShard's plan), so that a bucket
// covered by the previous bucket's sums, reduced on another stream, would
// land before those sums were read, were it not made to wait.
type slowHostedComm struct {
	Comm
	calls int
}

func (c *slowHostedComm) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	if c.calls++; c.calls%2 == 1 {
		if err := s.(*HostStream).Launch(func() error { time.Sleep(20 * time.Millisecond); return nil }); err != nil {
			return err
		}
	}
	return c.Comm.ReduceScatter(s, send, recv, op)
}

// TestLocalSumsInShardAcrossStreams: ZeRO-1's boundary backward reduces
// each bucket on the stream that completed it; with the hosted buckets'
// reductions held back, the covered buckets' landings must still wait for
// them: the shard keeps the bits of the run with every sum apart.
func TestLocalSumsInShardAcrossStreams(t *testing.T) {
	seed := testSeed(t)
	params := make([]Param, 8)
	for i := range params {
		params[i] = Param{Name: fmt.Sprint("p", i), Count: 4096, DType: BF16}
	}
	r := runSpec{stage: 1, world: 2, dtype: BF16, shard: BF16, windowDType: BF16, bucket: 8192, backwards: 2, steps: 2,
		streams: 2, predivide: 1, boundary: true}
	data := makeWorkload(mrand.New(mrand.NewSource(seed)), r, params)
	run := func(hosted bool) []rankResult {
		hostSumsInShard = hosted
		defer func() { hostSumsInShard = true }()
		comms, err := NewLocalGroupTimeout(r.world, 20*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return runRanks(t, r, func(cfg Config, rank int, out *rankResult) error {
			return runRank(cfg, &slowHostedComm{Comm: comms[rank]}, r, params, data, seed, out)
		})
	}
	if err := sameShards(run(false), run(true)); err != nil {
		t.Fatal(err)
	}
}
