package zero

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestStage3EqualsStage2: training at stage 3, with each layer gathered for
// its forward and again for its backward, gives stage 2's bits for the same
// W, bucket size and inputs (the same reductions and optimizer; parameters
// gathered from the same shard): W 1, 2, 3, 4 and 8 with sizes that do not
// divide by W, fp32 and bf16, prefetch on and off, a build from the
// parameters' memory (overwritten with NaN after New) and a sharded build.
func TestStage3EqualsStage2(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	sizes := []int{37, 130, 8, 257, 61}
	const steps = 4
	for _, dt := range []DType{FP32, BF16} {
		for _, world := range []int{1, 2, 3, 4, 8} {
			q := newQuadTask(rng, sizes, steps, world)
			q.roundTo(dt)
			base := z3Run{stage: 2, world: world, dtype: dt, bucket: 512, steps: steps}
			want := trainZ3(t, q, base)
			for _, v := range []struct {
				name     string
				prefetch int
				sharded  bool
			}{{"prefetch", 1024, false}, {"no prefetch", -1, false}, {"sharded build", 1024, true}} {
				r := base
				r.stage, r.prefetch, r.sharded = 3, v.prefetch, v.sharded
				got := trainZ3(t, q, r)
				for rank := range got.final {
					if !slices.Equal(got.final[rank], want.final[rank]) {
						t.Fatalf("%v W=%d %s: rank %d's parameters differ from stage 2's", dt, world, v.name, rank)
					}
				}
				if v.prefetch > 0 && world > 1 {
					if h := got.stats[steps-1].PrefetchHits; h == 0 {
						t.Errorf("%v W=%d: no prefetch hit in the last step", dt, world)
					}
				}
			}
		}
	}
}

// TestStage3MemoryAndPrefetch: in a traced run, after every Gather and
// Release the parameter memory is the shard plus the gather buffers
// (gathered or pooled), the gathered bytes are those of the buckets gathered
// now, and they stay within the live budget (the framework holds one layer
// at a time here, so only prefetching could pass it). With the layers in
// another order in one step the result keeps stage 2's bits; the stats
// count the prefetches that order wasted or missed.
func TestStage3MemoryAndPrefetch(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	sizes := []int{100, 100, 100, 100, 100, 100}
	const steps = 4
	q := newQuadTask(rng, sizes, steps, 2)
	shuffled := func(st int) []int {
		if st == 2 {
			return []int{0, 3, 1, 5, 2, 4}
		}
		return []int{0, 1, 2, 3, 4, 5}
	}
	want := trainZ3(t, q, z3Run{stage: 2, world: 2, dtype: FP32, bucket: 400, steps: steps, order: shuffled})
	for _, live := range []int{0, 2 * 512, 3 * 512} {
		checks := 0
		r := z3Run{stage: 3, world: 2, dtype: FP32, bucket: 400, steps: steps, order: shuffled,
			prefetch: 4 * 512, live: live,
			check: func(e *Engine, what string) error {
				checks++
				m := e.ParamMemory()
				buf := int64(e.Plan().MaxBucket() * 4)
				if m.ShardBytes != int64(e.Plan().ShardElems*4) {
					return fmt.Errorf("%s: shard %d bytes, want %d", what, m.ShardBytes, e.Plan().ShardElems*4)
				}
				if m.GatheredBytes != int64(m.GatheredBuckets)*buf {
					return fmt.Errorf("%s: %d gathered bytes for %d buckets of %d", what, m.GatheredBytes, m.GatheredBuckets, buf)
				}
				if m.GatheredBytes+m.PooledBytes != int64(m.Buffers)*buf {
					return fmt.Errorf("%s: gathered %d + pooled %d bytes, %d buffers of %d", what, m.GatheredBytes, m.PooledBytes, m.Buffers, buf)
				}
				if total := m.ShardBytes + m.GatheredBytes + m.PooledBytes; total > m.PeakBytes {
					return fmt.Errorf("%s: %d bytes now, above the peak %d", what, total, m.PeakBytes)
				}
				if live > 0 && m.GatheredBytes > max(int64(live), buf) {
					return fmt.Errorf("%s: %d bytes gathered, over the live budget %d", what, m.GatheredBytes, live)
				}
				return nil
			}}
		got := trainZ3(t, q, r)
		for rank := range got.final {
			if !slices.Equal(got.final[rank], want.final[rank]) {
				t.Fatalf("live %d: rank %d's parameters differ from stage 2's", live, rank)
			}
		}
		s1, s2 := got.stats[1], got.stats[2]
		t.Logf("live %d: %d checks; step 2 hits %d misses %d wasted %d; step 3 (shuffled) hits %d misses %d wasted %d; peak %d bytes",
			live, checks, s1.PrefetchHits, s1.PrefetchMisses, s1.PrefetchWasted, s2.PrefetchHits, s2.PrefetchMisses, s2.PrefetchWasted, s1.PeakParamBytes)
		if s1.PrefetchHits == 0 || s1.PrefetchMisses != 0 || s1.PrefetchWasted != 0 {
			t.Errorf("live %d: step 2 repeats step 1's order: hits %d misses %d wasted %d, want every gather a hit (the first prefetched at Step)", live, s1.PrefetchHits, s1.PrefetchMisses, s1.PrefetchWasted)
		}
		if s2.PrefetchMisses+s2.PrefetchWasted == 0 {
			t.Errorf("live %d: the shuffled step wasted and missed nothing", live)
		}
	}
}

// TestStage3Errors: the gathers' misuse gets typed errors that change
// nothing: Gather or Release below stage 3 or of a frozen parameter,
// Release of what is not gathered (or twice), Step with a release missing
// (on every rank, keeping the window), Init below stage 3, Data with Init.
func TestStage3Errors(t *testing.T) {
	mk := func() []Param {
		return []Param{{Name: "a", Count: 10, DType: FP32, Data: Float32s(make([]float32, 10))},
			{Name: "f", Count: 4, DType: FP32, Data: Float32s(make([]float32, 4)), Frozen: true}}
	}
	comms, _ := NewLocalGroup(1)
	init := func([]float32, int) error { return nil }
	bad := mk()
	bad[0].Init = init
	if _, err := New(Config{Stage: 3, BucketBytes: 1024}, comms[0], bad); !errors.Is(err, ErrParam) {
		t.Errorf("Data and Init: %v, want ErrParam", err)
	}
	bad = mk()
	bad[0].Data, bad[0].Init = Tensor{}, init
	if _, err := New(Config{Stage: 2, BucketBytes: 1024}, comms[0], bad); !errors.Is(err, ErrParam) {
		t.Errorf("Init at stage 2: %v, want ErrParam", err)
	}
	e2, err := New(Config{Stage: 2, BucketBytes: 1024}, comms[0], mk())
	if err != nil {
		t.Fatal(err)
	}
	s := NewHostStream()
	defer s.Close()
	if _, err := e2.Gather(s, 0); !errors.Is(err, ErrProtocol) {
		t.Errorf("Gather at stage 2: %v, want ErrProtocol", err)
	}
	e2.Close()

	comms, _ = NewLocalGroupTimeout(2, 10*time.Second)
	errs := eachRank(2, func(rank int) error {
		defer comms[rank].Close()
		s := NewHostStream() // each rank its own: a shared stream would serialize the ranks' collectives
		defer s.Close()
		e, err := New(Config{Stage: 3, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.1)}}}, comms[rank], mk())
		if err != nil {
			return err
		}
		defer e.Close()
		if _, err := e.Gather(s, 1); !errors.Is(err, ErrParam) {
			return fmt.Errorf("Gather of a frozen parameter: %v, want ErrParam", err)
		}
		if err := e.Release(s, 0); !errors.Is(err, ErrProtocol) {
			return fmt.Errorf("Release of what is not gathered: %v, want ErrProtocol", err)
		}
		if _, err := e.Gather(s, 0); err != nil {
			return err
		}
		if err := e.Release(s, 0, 0); !errors.Is(err, ErrProtocol) {
			return fmt.Errorf("Release twice of one Gather: %v, want ErrProtocol", err)
		}
		if _, err := e.GradReady(0, Float32s(make([]float32, 10)), s); err != nil {
			return err
		}
		if err := e.EndBackward(); err != nil {
			return err
		}
		if rank == 1 { // only rank 1 keeps its reference
			if err := e.Step(); !errors.Is(err, ErrProtocol) {
				return fmt.Errorf("Step with a release missing: %v, want ErrProtocol", err)
			}
			if err := e.Release(s, 0); err != nil {
				return err
			}
		} else {
			if err := e.Release(s, 0); err != nil {
				return err
			}
			if err := e.Step(); !errors.Is(err, ErrProtocol) {
				return fmt.Errorf("Step while rank 1 holds a reference: %v, want ErrProtocol", err)
			}
		}
		if err := e.Step(); err != nil { // the window was kept
			return fmt.Errorf("Step after the release: %v", err)
		}
		if st := e.Stats(); st.Backwards != 1 {
			return fmt.Errorf("the step saw %d backwards, want the kept window's 1", st.Backwards)
		}
		return nil
	})
	everyRankIs(t, "stage 3 errors", errs, nil)
}

// TestStage3CloseFreesEverything: Close with a bucket still gathered and
// another prefetched frees every byte.
func TestStage3CloseFreesEverything(t *testing.T) {
	dev := newCountingDevice()
	defer dev.release()
	comms, _ := NewLocalGroup(1)
	ps := []Param{{Count: 300, DType: FP32, Data: Float32s(make([]float32, 300))}, {Count: 300, DType: FP32, Data: Float32s(make([]float32, 300))}}
	e, err := New(Config{Stage: 3, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.1)}}}, onDevice{comms[0], dev}, ps)
	if err != nil {
		t.Fatal(err)
	}
	s := NewHostStream()
	defer s.Close()
	for range 2 { // a first window records the order, the second prefetches
		for _, p := range []int{0, 1} {
			if _, err := e.Gather(s, p); err != nil {
				t.Fatal(err)
			}
			if err := e.Release(s, p); err != nil {
				t.Fatal(err)
			}
		}
		for _, p := range []int{1, 0} {
			if _, err := e.GradReady(p, Float32s(make([]float32, 300)), s); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.EndBackward(); err != nil {
			t.Fatal(err)
		}
		if err := e.Step(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.Gather(s, 0); err != nil { // gathers bucket 0 and prefetches bucket 1
		t.Fatal(err)
	}
	if m := e.ParamMemory(); m.GatheredBuckets != 2 {
		t.Fatalf("%d buckets gathered, want 2 (one asked for, one prefetched)", m.GatheredBuckets)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if b := dev.liveBytes(); b != 0 {
		t.Fatalf("%d bytes still allocated after Close", b)
	}
}

// TestStage3ReleaseWaitsForTheUser: a bucket released by a stream whose
// work has not run yet keeps its buffer until that work has: the next
// gather into the same pooled buffer waits for it, also when it starts by
// copying the shard's part from the host (Offload.Params).
func TestStage3ReleaseWaitsForTheUser(t *testing.T) {
	for _, onHost := range []bool{false, true} {
		releaseWaitsForTheUser(t, onHost)
	}
}

func releaseWaitsForTheUser(t *testing.T, onHost bool) {
	comms, _ := NewLocalGroup(1)
	ones, twos := make([]float32, 256), make([]float32, 256)
	for i := range ones {
		ones[i], twos[i] = 1, 2
	}
	ps := []Param{{Name: "a", Count: 256, DType: FP32, Data: Float32s(ones)}, {Name: "b", Count: 256, DType: FP32, Data: Float32s(twos)}}
	e, err := New(Config{Stage: 3, BucketBytes: 1024, Params: ParamPolicy{PrefetchBytes: -1}, Offload: OffloadPolicy{Params: onHost}}, comms[0], ps)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if len(e.Plan().Buckets) != 2 {
		t.Fatalf("%d buckets, want one per parameter", len(e.Plan().Buckets))
	}
	a, open := gateStream()
	defer a.Close()
	b := NewHostStream()
	defer b.Close()
	views, err := e.Gather(a, 1) // bucket 0 holds parameter 1 (backward order)
	if err != nil {
		t.Fatal(err)
	}
	seen := make([]float32, 256)
	a.Launch(func() error { copy(seen, views[0].hostFloats()); return nil })
	if err := e.Release(a, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Gather(b, 0); err != nil { // the pool's one buffer again
		t.Fatal(err)
	}
	if m := e.ParamMemory(); m.Buffers != 1 {
		t.Fatalf("%d gather buffers, want the one reused", m.Buffers)
	}
	open()
	if err := a.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	for i, x := range seen {
		if x != 2 {
			t.Fatalf("shard on the host %v: the released view read %v at %d, want 2: the next gather overwrote it before its user ran", onHost, x, i)
		}
	}
	if err := e.Release(b, 0); err != nil {
		t.Fatal(err)
	}
}

// TestCoalesceTraining: AdamW training whose steps take 3 backwards in a
// coalesced window, at stages 2 and 3 (with the layers gathered inside the
// window), with and without Overlap, with clipping, in fp32, bf16 and fp16
// (a static loss scale the trainer multiplies in), gives the bits of
// ZeRO-1 training without a window: the same local sums, one reduction.
func TestCoalesceTraining(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	sizes := []int{37, 130, 8, 257}
	const steps, backwards, world = 4, 3, 2
	for _, dt := range []DType{FP32, BF16, FP16} {
		q := newQuadTask(rng, sizes, steps, world*backwards)
		q.roundTo(dt)
		base := z3Run{stage: 1, world: world, dtype: dt, bucket: 512, steps: steps, backwards: backwards, clip: 5}
		if dt == FP16 {
			base.lossScale = LossScale{Static: 1024}
		}
		want := trainZ3(t, q, base)
		for _, stage := range []int{2, 3} {
			for _, overlap := range []bool{false, true} {
				r := base
				r.stage, r.overlap, r.window = stage, overlap, true
				got := trainZ3(t, q, r)
				for rank := range got.final {
					if !slices.Equal(got.final[rank], want.final[rank]) {
						t.Fatalf("%v stage %d overlap=%v: rank %d's parameters differ from ZeRO-1's", dt, stage, overlap, rank)
					}
				}
				for st, s := range got.stats {
					if s.Skipped {
						t.Fatalf("%v stage %d: step %d skipped", dt, stage, st)
					}
				}
			}
		}
	}
}

// stage3Engine is a one-rank stage-3 engine over params of 256 fp32
// elements each, one bucket per parameter, holding values 1, 2, 3, ….
func stage3Engine(t *testing.T, n int, cfg Config) (*Engine, []Param) {
	t.Helper()
	ps := make([]Param, n)
	for p := range ps {
		x := make([]float32, 256)
		for i := range x {
			x[i] = float32(p + 1)
		}
		ps[p] = Param{Name: fmt.Sprint("p", p), Count: 256, DType: FP32, Data: Float32s(x)}
	}
	comms, _ := NewLocalGroup(1)
	cfg.Stage, cfg.BucketBytes = 3, 1024
	e, err := New(cfg, comms[0], ps)
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Plan().Buckets) != n {
		t.Fatalf("%d buckets, want one per parameter", len(e.Plan().Buckets))
	}
	return e, ps
}

// holdGathers makes the engine's gather stream wait until the returned
// function is called.
func holdGathers(t *testing.T, e *Engine) (open func()) {
	t.Helper()
	gated, open := gateStream()
	t.Cleanup(func() { open(); gated.Close() })
	ev, err := gated.Record()
	if err == nil {
		err = e.gatherStream.Wait(ev)
	}
	if err != nil {
		t.Fatal(err)
	}
	return open
}

// readView enqueues on s a copy of a view's values, read when s runs it.
func readView(s *HostStream, v Tensor) []float32 {
	seen := make([]float32, v.count)
	s.Launch(func() error { copy(seen, v.hostFloats()); return nil })
	return seen
}

func allEqual(x []float32, want float32) error {
	for i, v := range x {
		if v != want {
			return fmt.Errorf("element %d is %v, want %v", i, v, want)
		}
	}
	return nil
}

// TestStage3SecondStreamWaitsForTheGather: a bucket gathered for one
// stream and asked for again from another, while its all-gather has not
// landed, makes the second stream wait for it too.
func TestStage3SecondStreamWaitsForTheGather(t *testing.T) {
	e, _ := stage3Engine(t, 2, Config{Params: ParamPolicy{PrefetchBytes: -1}})
	defer e.Close()
	open := holdGathers(t, e)
	defer open()
	a, b := NewHostStream(), NewHostStream()
	defer a.Close()
	defer b.Close()
	// parameter 1 is bucket 0, loaded first at New: the pooled buffer
	// holds the last bucket loaded, parameter 0's, until the gather lands
	if _, err := e.Gather(a, 1); err != nil {
		t.Fatal(err)
	}
	views, err := e.Gather(b, 1) // already gathered: no second all-gather
	if err != nil {
		t.Fatal(err)
	}
	seen := readView(b, views[0])
	settle(t, b) // b ran what it could before the gather lands
	open()
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := allEqual(seen, 2); err != nil {
		t.Fatalf("the second stream read the view before its gather landed: %v", err)
	}
	if err := e.Release(a, 1); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(b, 1); err != nil {
		t.Fatal(err)
	}
}

// TestStage3StepWaitsForTheGathers: the optimizer's update of the shard
// waits for the window's gathers, which read it: a forward's view holds the
// parameters from before the step even when the gather ran late.
func TestStage3StepWaitsForTheGathers(t *testing.T) {
	e, ps := stage3Engine(t, 2, Config{Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.5)}}, Params: ParamPolicy{PrefetchBytes: -1}})
	defer e.Close()
	open := holdGathers(t, e)
	defer open() // before Close, which waits for the engine's streams
	a, b := NewHostStream(), NewHostStream()
	defer a.Close()
	defer b.Close()
	views, err := e.Gather(a, 0)
	if err != nil {
		t.Fatal(err)
	}
	seen := readView(a, views[0])
	if err := e.Release(a, 0); err != nil {
		t.Fatal(err)
	}
	// the backward on a stream of its own: its reductions do not wait for the gather
	if err := backward(e, b, constGrads(ps, 1)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- e.Step() }()
	// Open once Step waits for the held gathers. A Step that does not wait
	// for them has run its optimizer long before a second has passed.
	reduce, gather := e.reduceStream.(*HostStream), e.gatherStream.(*HostStream)
	for start := time.Now(); time.Since(start) < time.Second; time.Sleep(50 * time.Microsecond) {
		if w := reduce.blockedOn.Load(); w != nil && w.s == gather && w.s.done.Load() < w.seq {
			break
		}
	}
	open()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := a.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := allEqual(seen, 1); err != nil {
		t.Fatalf("the forward's view holds the stepped parameters: %v", err)
	}
}

// TestStage3LiveParamBytes: a released bucket that the last window's order
// needs again soon is kept gathered only within LiveParamBytes; over it,
// it is dropped as any other (gathers the framework asks for always run).
func TestStage3LiveParamBytes(t *testing.T) {
	const size = 1024 // one bucket's buffer
	e, ps := stage3Engine(t, 3, Config{Params: ParamPolicy{PrefetchBytes: 4 * size, LiveParamBytes: size}})
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	gather := func(p int) {
		if _, err := e.Gather(s, p); err != nil {
			t.Fatal(err)
		}
	}
	release := func(p int) {
		if err := e.Release(s, p); err != nil {
			t.Fatal(err)
		}
	}
	for w := range 2 { // the first window records the order [0 1 2 1], the second follows it
		gather(0)
		release(0)
		gather(1)
		gather(2)
		release(1) // 1 comes next in the order, but 2 is held: keeping 1 would pass the budget
		if m := e.ParamMemory(); m.GatheredBytes > size {
			t.Fatalf("window %d: %d bytes gathered with one bucket held and a budget of %d", w, m.GatheredBytes, size)
		}
		gather(1)
		release(1)
		release(2)
		if err := backward(e, s, constGrads(ps, 1)); err != nil {
			t.Fatal(err)
		}
		if err := e.Step(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestStage3PrefetchStats: the first window has no order to follow, so no
// misses; the second follows the first and hits; a third that asks for
// less than the order wastes what was prefetched for it, and one that asks
// in another order misses.
func TestStage3PrefetchStats(t *testing.T) {
	e, ps := stage3Engine(t, 4, Config{Params: ParamPolicy{PrefetchBytes: 1024}})
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	grads := constGrads(ps, 1)
	window := func(order ...int) Stats {
		for _, p := range order {
			if _, err := e.Gather(s, p); err != nil {
				t.Fatal(err)
			}
			if err := e.Release(s, p); err != nil {
				t.Fatal(err)
			}
		}
		for _, p := range order { // the gradients of what the forward read
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
	type counts struct{ hits, misses, wasted int }
	for i, c := range []struct {
		order []int
		want  counts
	}{
		{[]int{0, 1, 2, 3}, counts{0, 0, 0}}, // no order yet
		{[]int{0, 1, 2, 3}, counts{4, 0, 0}}, // each one prefetched (the first at Step)
		{[]int{0, 1}, counts{2, 0, 1}},       // 2 was prefetched after 1 and never asked for
		{[]int{1, 0}, counts{1, 1, 0}},       // the order was [0 1]: 1 missed, 0 prefetched at Step and used
	} {
		st := window(c.order...)
		if got := (counts{st.PrefetchHits, st.PrefetchMisses, st.PrefetchWasted}); got != c.want {
			t.Errorf("window %d (order %v): hits, misses, wasted %+v, want %+v", i, c.order, got, c.want)
		}
	}
}

// TestStage3RepeatedGathers: a parameter gathered twice (by one call or
// two) stays gathered until its last reference is released, and each
// reference is released once.
func TestStage3RepeatedGathers(t *testing.T) {
	e, ps := stage3Engine(t, 2, Config{Params: ParamPolicy{PrefetchBytes: -1}})
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	gathered := func(want int) {
		t.Helper()
		if m := e.ParamMemory(); m.GatheredBuckets != want {
			t.Fatalf("%d buckets gathered, want %d", m.GatheredBuckets, want)
		}
	}
	for _, twice := range [][][]int{{{0, 0}}, {{0}, {0}}, {{0, 1}, {0}}} {
		for _, ask := range twice {
			if _, err := e.Gather(s, ask...); err != nil {
				t.Fatal(err)
			}
		}
		views, err := e.Gather(s, 0, 1)
		if err != nil {
			t.Fatal(err)
		}
		seen := readView(s, views[0])
		if err := e.Release(s, 0, 1); err != nil {
			t.Fatal(err)
		}
		for i, ask := range twice {
			held := map[int]bool{} // parameters with references still out
			for _, rest := range twice[i:] {
				for _, p := range rest {
					held[p] = true
				}
			}
			gathered(len(held))
			if err := e.Release(s, ask...); err != nil {
				t.Fatal(err)
			}
		}
		gathered(0)
		if err := e.Release(s, 0); !errors.Is(err, ErrProtocol) {
			t.Fatalf("a release past the last reference: %v, want ErrProtocol", err)
		}
		if err := s.Sync(); err != nil {
			t.Fatal(err)
		}
		if err := allEqual(seen, 1); err != nil {
			t.Fatal(err)
		}
	}
	if err := backward(e, s, constGrads(ps, 1)); err != nil {
		t.Fatal(err)
	}
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
}

// TestFullParams: the current parameters read the same at every stage (bf16
// and fp32, with a frozen one): at stages 1 and 2 from Param.Data, at stage
// 3 gathered from the shards (index 4: with the shard in page-locked host
// memory, Offload.Params), while stage 3 leaves Param.Data as it was at
// New, as its doc says.
func TestFullParams(t *testing.T) {
	for _, dt := range []DType{FP32, BF16} {
		var reads [5][][]float32
		for _, run := range []int{1, 2, 3, 4} {
			stage, onHost := min(run, 3), run == 4
			comms, _ := NewLocalGroupTimeout(2, 10*time.Second)
			errs := eachRank(2, func(rank int) error {
				ps, bufs := smallModel(dt, 0.5)
				e, err := New(Config{Stage: stage, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.25)}},
					Offload: OffloadPolicy{Params: onHost}}, comms[rank], ps)
				if err != nil {
					return err
				}
				defer e.Close()
				s := NewHostStream()
				defer s.Close()
				before := snapshotState(e, bufs).params
				for range 2 {
					g := make([]Tensor, 3)
					for p := range g {
						b := newTBuf(dt, ps[p].Count)
						for j := range b.len() {
							b.set(j, float32(j%5+1)/4)
						}
						g[p] = b.t()
					}
					if err := backward(e, s, g); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
				}
				full, err := e.FullParams()
				if err != nil {
					return err
				}
				if stage == 3 && !slices.Equal(snapshotState(e, bufs).params, before) {
					return fmt.Errorf("stage 3 wrote Param.Data")
				}
				if rank == 0 {
					reads[run] = full
				}
				return nil
			})
			everyRankIs(t, fmt.Sprintf("%v stage %d, parameter offload %v", dt, stage, onHost), errs, nil)
		}
		for _, run := range []int{2, 3, 4} {
			for p := range reads[1] {
				if !slices.Equal(reads[run][p], reads[1][p]) {
					t.Fatalf("%v: parameter %d reads %v in run %d, %v at stage 1", dt, p, reads[run][p][:3], run, reads[1][p][:3])
				}
			}
		}
		if reads[1][0][0] == 0.5 {
			t.Fatalf("%v: the parameters did not move", dt)
		}
	}
}

// ---- parameter offload (Offload.Params) ---------------------------------------

// TestParamOffloadEqualsStage3: stage 3 with the parameter shard in
// page-locked host memory gives the bits of stage 3 without it, step by
// step: the parameters every rank gathers, the fp32 master, the moments
// and the model-dtype shard, and every Stats figure but the byte counts,
// which move the shard from the device's side to the host's. Over fp32,
// bf16 and fp16 (a dynamic loss scale that starts too high: steps skip),
// W 1, 2 and 4 with sizes that split unevenly into 512-byte buckets,
// prefetch on and off, a live budget, windows, the optimizer on the
// device and offloaded, clipping and a sharded build.
func TestParamOffloadEqualsStage3(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	sizes := []int{37, 130, 8, 257, 61}
	const steps, backwards = 4, 2
	runs := 0
	for _, dt := range []DType{FP32, BF16, FP16} {
		for _, world := range []int{1, 2, 4} {
			q := newQuadTask(rng, sizes, steps, world*backwards)
			q.roundTo(dt)
			for _, v := range []struct {
				name                     string
				prefetch, live           int
				window, offload, sharded bool
			}{
				{name: "prefetch", prefetch: 1024},
				{name: "no prefetch", prefetch: -1},
				{name: "live budget", prefetch: 4096, live: 2 * 512},
				{name: "window", prefetch: 1024, window: true},
				{name: "optimizer offloaded", prefetch: 1024, offload: true},
				{name: "optimizer offloaded, no prefetch, window", prefetch: -1, offload: true, window: true},
				{name: "sharded build", prefetch: 1024, sharded: true},
			} {
				r := z3Run{stage: 3, world: world, dtype: dt, bucket: 512, steps: steps, backwards: backwards, clip: 0.5,
					prefetch: v.prefetch, live: v.live, window: v.window, offload: v.offload, sharded: v.sharded, overlap: rng.Intn(2) == 0}
				if dt == FP16 {
					r.lossScale = LossScale{Initial: 1 << 22, Hysteresis: 1}
				}
				want := trainZ3(t, q, r)
				r.offloadParams = true
				got := trainZ3(t, q, r)
				what := fmt.Sprintf("%v W=%d %s overlap=%v", dt, world, v.name, r.overlap)
				sameParamOffloadRun(t, what, got, want)
				skipped := 0
				for _, s := range got.stats {
					if s.Skipped {
						skipped++
					}
				}
				if dt == FP16 && skipped == 0 {
					t.Fatalf("%s: no step skipped; the fp16 runs start with a scale that overflows", what)
				}
				runs++
			}
		}
	}
	t.Logf("%d configurations bit-identical with the parameter shard on the host", runs)
}

// sameParamOffloadRun fails t where a run with Offload.Params differs from
// want, the same run without it: in a bit of the parameters or of a state
// tensor, in a Stats figure other than a byte count or a time, or in the
// byte counts other than by the shard's move to the host.
func sameParamOffloadRun(t *testing.T, what string, got, want z3Result) {
	t.Helper()
	for rank := range want.final {
		if !slices.Equal(got.final[rank], want.final[rank]) {
			t.Fatalf("%s: rank %d's parameters differ from stage 3 without parameter offload", what, rank)
		}
		for name, b := range want.state[rank].state {
			if i := firstByteDiff(got.state[rank].state[name], b); i >= 0 {
				t.Fatalf("%s: rank %d's %s differs from stage 3 without parameter offload at byte %d", what, rank, name, i)
			}
		}
	}
	for st := range want.stats {
		g, w := got.stats[st], want.stats[st]
		if d := statsDiffBut(g, w); d != "" {
			t.Fatalf("%s: step %d: Stats differ in more than the byte counts:%s", what, st, d)
		}
		shard := w.ParamShardBytes
		if shard == 0 || g.ParamShardBytes != 0 || g.HostParamBytes != shard || g.PeakParamBytes != w.PeakParamBytes-shard ||
			g.DeviceBytesSaved != w.DeviceBytesSaved+shard {
			t.Fatalf("%s: step %d: device shard %d, host shard %d, peak %d, saved %d; without parameter offload %d, 0, %d, %d: the shard's %d bytes must move to the host",
				what, st, g.ParamShardBytes, g.HostParamBytes, g.PeakParamBytes, g.DeviceBytesSaved, w.ParamShardBytes, w.PeakParamBytes, w.DeviceBytesSaved, shard)
		}
		// with the optimizer offloaded the host's copy of the new
		// parameters goes: the step writes the host's shard
		if w.HostBytes > 0 && g.HostBytes != w.HostBytes || w.HostBytes == 0 && g.HostBytes != shard {
			t.Fatalf("%s: step %d: host bytes %d, without parameter offload %d (shard %d)", what, st, g.HostBytes, w.HostBytes, shard)
		}
		for _, f := range []string{"PeakGradBytes", "OptimizerBytes", "ControlBytes", "HostGradBytes"} {
			if gv, wv := reflect.ValueOf(g).FieldByName(f).Int(), reflect.ValueOf(w).FieldByName(f).Int(); gv != wv {
				t.Fatalf("%s: step %d: %s %d, without parameter offload %d", what, st, f, gv, wv)
			}
		}
	}
}

// statsDiffBut lists the fields of two Stats that differ, leaving out the
// byte counts and the times.
func statsDiffBut(got, want Stats) string {
	var out strings.Builder
	gv, wv := reflect.ValueOf(got), reflect.ValueOf(want)
	for i := range gv.NumField() {
		f := gv.Type().Field(i)
		if strings.HasSuffix(f.Name, "Bytes") || f.Name == "DeviceBytesSaved" || f.Type == reflect.TypeOf(time.Duration(0)) {
			continue
		}
		same := reflect.DeepEqual(gv.Field(i).Interface(), wv.Field(i).Interface())
		if f.Type.Kind() == reflect.Float64 { // a NaN norm equals itself here
			same = math.Float64bits(gv.Field(i).Float()) == math.Float64bits(wv.Field(i).Float())
		}
		if !same {
			fmt.Fprintf(&out, "\n\t%s %v, without parameter offload %v", f.Name, gv.Field(i).Interface(), wv.Field(i).Interface())
		}
	}
	return out.String()
}

// holdStream makes s (one of the engine's) wait until the returned
// function is called.
func holdStream(t *testing.T, s Stream) (open func()) {
	t.Helper()
	gated, open := gateStream()
	t.Cleanup(func() { open(); gated.Close() })
	ev, err := gated.Record()
	if err == nil {
		err = s.Wait(ev)
	}
	if err != nil {
		t.Fatal(err)
	}
	return open
}

// TestParamOffloadGatherOnItsStream: with the parameter shard on the host,
// a gather copies the shard's part into the gather buffer on the gather
// stream itself, ahead of its all-gather: with every other stream of the
// engine held (the reductions' and the step's, the copies', the offload's
// host stream), a Gather's view still lands, holding the bucket's values.
// A copy enqueued on another stream would leave the buffer's old contents
// in the view, or make the gather wait for a held stream.
func TestParamOffloadGatherOnItsStream(t *testing.T) {
	for _, offload := range []bool{false, true} {
		e, _ := stage3Engine(t, 3, Config{Offload: OffloadPolicy{Params: true, Optimizer: offload},
			Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.5)}}, Params: ParamPolicy{PrefetchBytes: -1}})
		defer e.Close()
		held := []Stream{e.reduceStream, e.copyStream}
		if offload {
			held = append(held, e.off.hostStream())
		}
		var opens []func()
		for _, s := range held {
			opens = append(opens, holdStream(t, s))
		}
		a := NewHostStream()
		for p := range 3 {
			views, err := e.Gather(a, p)
			if err != nil {
				t.Fatal(err)
			}
			seen := readView(a, views[0])
			synced := make(chan error, 1)
			go func() { synced <- a.Sync() }()
			select {
			case err := <-synced:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("offload=%v: the gather of parameter %d waits for a stream other than the gather stream", offload, p)
			}
			if err := allEqual(seen, float32(p+1)); err != nil {
				t.Fatalf("offload=%v: parameter %d's view: %v", offload, p, err)
			}
			if err := e.Release(a, p); err != nil {
				t.Fatal(err)
			}
		}
		for _, open := range opens {
			open()
		}
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestParamOffloadPrefetchWaitsForTheUser: a bucket the prefetch gathers
// into a pooled buffer whose last user's stream has not yet read it copies
// the host shard's part in only after that user: the user reads its own
// bucket's values.
func TestParamOffloadPrefetchWaitsForTheUser(t *testing.T) {
	e, ps := stage3Engine(t, 3, Config{Offload: OffloadPolicy{Params: true}, Params: ParamPolicy{PrefetchBytes: 1024}})
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	// a first window gives the prefetch its order: 0, 1, 2
	for p := range ps {
		if _, err := e.Gather(s, p); err != nil {
			t.Fatal(err)
		}
		if err := e.Release(s, p); err != nil {
			t.Fatal(err)
		}
	}
	if err := backward(e, s, constGrads(ps, 1)); err != nil {
		t.Fatal(err)
	}
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
	a, open := gateStream()
	defer a.Close()
	defer open()
	views, err := e.Gather(a, 0) // prefetched at Step; it prefetches parameter 1's bucket
	if err != nil {
		t.Fatal(err)
	}
	seen := readView(a, views[0])
	if err := e.Release(a, 0); err != nil { // its buffer goes back to the pool, free once a has read it
		t.Fatal(err)
	}
	if _, err := e.Gather(s, 1); err != nil { // prefetches parameter 2's bucket into that buffer
		t.Fatal(err)
	}
	if m := e.ParamMemory(); m.GatheredBuckets != 2 || m.Buffers != 2 {
		t.Fatalf("%d buckets gathered in %d buffers; want parameters 1 and 2, the prefetch reusing parameter 0's buffer", m.GatheredBuckets, m.Buffers)
	}
	settleBehind(t, e.gatherStream.(*HostStream), a)
	open()
	if err := a.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := allEqual(seen, 1); err != nil {
		t.Fatalf("parameter 0's view, read after the prefetch of parameter 2 into its buffer: %v", err)
	}
	if err := e.Release(s, 1); err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.HostParamBytes == 0 {
		t.Fatal("no parameter shard on the host")
	}
}

// deviceOnlyComm is a communicator whose collectives refuse buffers in
// page-locked host memory, as NCCL's kernels need device memory: it holds
// an engine on the CPU to what it must do on a GPU.
type deviceOnlyComm struct {
	Comm
	dev *countingDevice
}

func (c deviceOnlyComm) check(op string, ts ...Tensor) error {
	for _, t := range ts {
		if t.count > 0 && c.dev.pinned(t) {
			return fmt.Errorf("%s of a buffer in page-locked host memory: a GPU collective needs device memory", op)
		}
	}
	return nil
}

func (c deviceOnlyComm) AllReduce(s Stream, buf Tensor, op ReduceOp) error {
	return errors.Join(c.check("AllReduce", buf), c.Comm.AllReduce(s, buf, op))
}

func (c deviceOnlyComm) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	if err := c.check("ReduceScatter", send, recv); err != nil {
		return err
	}
	return c.Comm.ReduceScatter(s, send, recv, op)
}

func (c deviceOnlyComm) AllGather(s Stream, send, recv Tensor) error {
	if err := c.check("AllGather", send, recv); err != nil {
		return err
	}
	return c.Comm.AllGather(s, send, recv)
}

func (c deviceOnlyComm) Broadcast(s Stream, buf Tensor, root int) error {
	if err := c.check("Broadcast", buf); err != nil {
		return err
	}
	return c.Comm.Broadcast(s, buf, root)
}

// TestParamOffloadCollectivesReadDeviceMemory: with the parameter shard
// (and the optimizer's state) in page-locked host memory, every collective
// the engine issues reads and writes device memory only, as NCCL needs:
// New's load, each gather and prefetch (the shard's part copied into the
// gather buffer first), the step, FullParams, FullGrads. Two ranks, three
// steps of two backwards.
func TestParamOffloadCollectivesReadDeviceMemory(t *testing.T) {
	sizes := []int{300, 77, 1000, 129}
	for _, offload := range []bool{false, true} {
		comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
		errs := eachRank(2, func(rank int) error {
			dev := newCountingDevice()
			defer dev.release()
			ps := make([]Param, len(sizes))
			for p, n := range sizes {
				x := make([]float32, n)
				for i := range x {
					x[i] = float32(p) + float32(i)/1000
				}
				ps[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: FP32, Data: Float32s(x)}
			}
			cfg := Config{Stage: 3, BucketBytes: 1024, Overlap: true, Offload: OffloadPolicy{Params: true, Optimizer: offload},
				Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.01)}}}
			e, err := New(cfg, deviceOnlyComm{onDevice{comms[rank], dev}, dev}, ps)
			if err != nil {
				return err
			}
			defer e.Close()
			s := NewHostStream()
			defer s.Close()
			for range 3 {
				for range 2 {
					if err := backward(e, s, constGrads(ps, float32(rank+1))); err != nil {
						return err
					}
				}
				if err := e.Step(); err != nil {
					return err
				}
			}
			if _, err := e.FullParams(); err != nil {
				return err
			}
			if _, err := e.FullGrads(); err != nil {
				return err
			}
			if st := e.Stats(); st.PrefetchHits == 0 {
				return fmt.Errorf("no prefetch hit: the prefetch's gathers went unchecked")
			}
			return nil
		})
		for rank, err := range errs {
			if err != nil {
				t.Fatalf("optimizer offloaded %v: rank %d: %v", offload, rank, err)
			}
		}
	}
}
