package zero

import (
	"fmt"
	"math"
	"math/rand"
	"slices"
	"sync"
	"testing"
	"time"
)

// testSeed gives fresh data every run; the seed is logged, and
// ZERO_TEST_SEED=n replays a run (as testRNG does for the kernel tests).
func testSeed(t testing.TB) int64 {
	t.Helper()
	return int64(seedFromEnv(t))
}

// grad is one rank's gradient of one parameter in one backward, in the
// model dtype, with the exact float64 value of every element.
type grad struct {
	t   Tensor
	ref []float64
}

func makeGrad(rng *rand.Rand, n int, d DType, scale float64) grad {
	g := grad{ref: make([]float64, n)}
	switch d {
	case FP32:
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * scale)
			g.ref[i] = float64(x[i])
		}
		g.t = Float32s(x)
	default:
		x := make([]uint16, n)
		for i := range x {
			f := float32(rng.NormFloat64() * scale)
			if d == BF16 {
				x[i] = bf16FromFloat(f)
				g.ref[i] = float64(floatFromBF16(x[i]))
			} else {
				x[i] = fp16FromFloat(f)
				g.ref[i] = float64(floatFromFP16(x[i]))
			}
		}
		g.t = Halfs(x, d)
	}
	return g
}

// testParams is a small model: sizes chosen so tiny buckets split it into
// many buckets, some parameters larger than a bucket, and one empty.
func testParams(d DType) []Param {
	sizes := []int{300, 7, 1000, 0, 129, 64, 513, 1}
	ps := make([]Param, len(sizes))
	for i, n := range sizes {
		ps[i] = Param{Name: fmt.Sprintf("p%d", i), Count: n, DType: d}
	}
	return ps
}

type runSpec struct {
	stage     int
	world     int
	dtype     DType
	comm      DType
	overlap   bool
	bucket    int
	backwards int
	predivide float64
	accum     int // GradAccumSteps; 0 = count the backwards
	reduction Reduction
	steps     int
	streams   int
	shuffle   bool
	boundary  bool // SetBoundary(true) before the last backward of a step
	boundAll  bool // SetBoundary(true) before every backward
	batch     bool // hand gradients over in random batches (GradsReady)
	// window is "coalesce" (every backward of a step in a window) or
	// "nosync" (all but the last backward in NoSync); windowEvery puts
	// the window in every step, otherwise in the even steps only.
	window      string
	windowEvery bool
	budget      int   // Config.CoalesceBudgetBytes
	windowDType DType // Config.WindowDType
	offload     bool  // Config.Offload
	// poison writes junk into every view of the shard after each step's
	// reads: the next window's first reductions must copy over it.
	poison bool
}

func (r runSpec) String() string {
	return fmt.Sprintf("z%d/w%d/%v/ov=%v/b%d/n%d/f%g", r.stage, r.world, r.dtype, r.overlap, r.bucket, r.backwards, r.predivide)
}

// workload holds data[step][backward][rank][param].
type workload [][][][]grad

func makeWorkload(rng *rand.Rand, r runSpec, params []Param) workload {
	w := make(workload, r.steps)
	for s := range w {
		w[s] = make([][][]grad, r.backwards)
		for k := range w[s] {
			w[s][k] = make([][]grad, r.world)
			for rank := range w[s][k] {
				w[s][k][rank] = make([]grad, len(params))
				for p, q := range params {
					w[s][k][rank][p] = makeGrad(rng, q.Count, q.DType, 0.5+rng.Float64())
				}
			}
		}
	}
	return w
}

// rankResult is what one rank read back after each step.
type rankResult struct {
	shard [][]float32   // per step
	full  [][][]float32 // per step, per param
	stats []Stats
	plan  *Plan
}

// runEngine runs the backward protocol on every rank of an in-process group.
func runEngine(t testing.TB, r runSpec, params []Param, data workload, seed int64) []rankResult {
	t.Helper()
	comms, err := NewLocalGroupTimeout(r.world, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return runRanks(t, r, func(cfg Config, rank int, out *rankResult) error {
		return runRank(cfg, comms[rank], r, params, data, seed, out)
	})
}

// runRanks runs run on every rank with r's config and fails t on an error.
func runRanks(t testing.TB, r runSpec, run func(cfg Config, rank int, out *rankResult) error) []rankResult {
	t.Helper()
	cfg := Config{Stage: r.stage, BucketBytes: r.bucket, Overlap: r.overlap, Precision: PrecisionPolicy{CommDType: r.comm}, Grads: GradPolicy{PredivideFactor: r.predivide, AccumSteps: r.accum, Reduction: r.reduction}, Window: WindowPolicy{BudgetBytes: r.budget, DType: r.windowDType}, Offload: OffloadPolicy{Optimizer: r.offload}}
	results := make([]rankResult, r.world)
	for rank, err := range eachRank(r.world, func(rank int) error { return run(cfg, rank, &results[rank]) }) {
		if err != nil {
			t.Fatalf("%v: rank %d: %v", r, rank, err)
		}
	}
	return results
}

// eachRank runs fn for ranks 0..n−1, each on a goroutine of its own, and
// returns their errors.
func eachRank(n int, fn func(rank int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for rank := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[rank] = fn(rank)
		}()
	}
	wg.Wait()
	return errs
}

func runRank(cfg Config, comm Comm, r runSpec, params []Param, data workload, seed int64, out *rankResult) error {
	defer comm.Close()
	grad := func(step, k, p int) Tensor { return data[step][k][comm.Rank()][p].t }
	return rankLoop(cfg, comm, CPU(), r, params, grad, seed, out)
}

// rankLoop runs r's steps of the backward protocol on one rank with
// r.streams producer streams of dev: grad gives the gradient of (step,
// backward, param), handed over from the streams in turn, and out collects
// what the rank reads back.
func rankLoop(cfg Config, comm Comm, dev Device, r runSpec, params []Param, grad func(step, k, p int) Tensor, seed int64, out *rankResult) error {
	e, err := New(cfg, comm, params)
	if err != nil {
		return err
	}
	defer e.Close()
	streams := make([]Stream, max(r.streams, 1))
	for i := range streams {
		if streams[i], err = dev.NewStream(); err != nil {
			return err
		}
		defer streams[i].Close()
	}
	nparams := len(params)
	out.plan = e.Plan()
	rng := rand.New(rand.NewSource(seed + int64(e.Rank())))
	order := make([]int, nparams)
	for step := range r.steps {
		window := r.window != "" && (r.windowEvery || step%2 == 0)
		if window && r.window == "coalesce" {
			if err := e.BeginCoalesce(); err != nil {
				return err
			}
		}
		if window && r.window == "nosync" && r.backwards > 1 {
			if err := e.BeginNoSync(); err != nil {
				return err
			}
		}
		for k := range r.backwards {
			if window && r.window == "nosync" && r.backwards > 1 && k == r.backwards-1 {
				if err := e.EndNoSync(); err != nil {
					return err
				}
			}
			for i := range order {
				order[i] = nparams - 1 - i
			}
			if r.shuffle {
				rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			}
			if r.boundAll || r.boundary && k == r.backwards-1 {
				e.SetBoundary(true)
			}
			for i := 0; i < len(order); {
				n := 1
				if r.batch {
					n = 1 + rng.Intn(len(order)-i)
				}
				batch := order[i : i+n]
				gs := make([]Tensor, n)
				for j, p := range batch {
					gs[j] = grad(step, k, p)
				}
				if _, err := e.GradsReady(batch, gs, streams[i%len(streams)]); err != nil {
					return err
				}
				i += n
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
		}
		if window && r.window == "coalesce" {
			if err := e.EndCoalesce(); err != nil {
				return err
			}
		}
		if err := e.Step(); err != nil {
			return err
		}
		shard, err := e.GradShard()
		if err != nil {
			return err
		}
		full, err := e.FullGrads()
		if err != nil {
			return err
		}
		out.shard = append(out.shard, shard)
		out.full = append(out.full, full)
		out.stats = append(out.stats, e.Stats())
		if r.poison {
			for p := range params {
				v, err := e.GradView(p)
				if err != nil {
					return err
				}
				junk := make([]float32, v.Count)
				for i := range junk {
					junk[i] = 1e30
				}
				if err := v.Write(junk); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// TestDifferentialMatrix runs every combination of stage, world, dtype,
// overlap, bucket size, backwards per step and predivide factor against the
// float64 mean.
func TestDifferentialMatrix(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	n := 0
	for _, stage := range []int{1, 2, 3} {
		for _, world := range []int{1, 2, 3, 4, 8} {
			for _, d := range []DType{FP32, BF16, FP16} {
				params := testParams(d)
				for _, backwards := range []int{1, 2, 4} {
					r0 := runSpec{stage: stage, world: world, dtype: d, backwards: backwards, steps: 2, streams: 2}
					data := makeWorkload(rng, r0, params)
					for _, overlap := range []bool{true, false} {
						for _, bucket := range []int{256, 32 << 20} {
							for _, f := range []float64{1, float64(world)} {
								r := r0
								r.overlap, r.bucket, r.predivide = overlap, bucket, f
								if bucket == 256 { // a fixed G half the time, counted the other half
									r.accum = backwards
								}
								res := runEngine(t, r, params, data, seed)
								checkMean(t, r, params, data, res)
								n++
							}
						}
					}
				}
			}
		}
	}
	t.Logf("%d combinations", n)
}

// TestBitExactInvariance: for a fixed world size, bucket size, overlap,
// arrival order and the number of producer streams change nothing in the
// bits of the averaged gradient.
func TestBitExactInvariance(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	for _, stage := range []int{1, 2, 3} {
		for _, d := range []DType{FP32, BF16, FP16} {
			params := testParams(d)
			base := runSpec{stage: stage, world: 3, dtype: d, backwards: 3, steps: 2, streams: 1, bucket: 32 << 20, predivide: 3}
			data := makeWorkload(rng, base, params)
			want := runEngine(t, base, params, data, seed)
			for _, v := range []runSpec{
				{bucket: 256, overlap: true, streams: 1},
				{bucket: 2000, overlap: false, streams: 3, shuffle: true},
				{bucket: 256, overlap: true, streams: 4, shuffle: true},
				{bucket: 32 << 20, overlap: true, streams: 2, shuffle: true, boundary: true},
				{bucket: 256, overlap: true, streams: 2, shuffle: true, batch: true},
				{bucket: 2000, overlap: false, streams: 3, batch: true, boundary: true},
			} {
				r := base
				r.bucket, r.overlap, r.streams, r.shuffle, r.boundary, r.batch = v.bucket, v.overlap, v.streams, v.shuffle, v.boundary, v.batch
				got := runEngine(t, r, params, data, seed+1)
				for step := range r.steps {
					for p := range params {
						for i := range got[0].full[step][p] {
							a, b := got[0].full[step][p][i], want[0].full[step][p][i]
							if math.Float32bits(a) != math.Float32bits(b) {
								t.Fatalf("%v shuffle=%v streams=%d: step %d param %d[%d] = %x, baseline %x", r, r.shuffle, r.streams, step, p, i, math.Float32bits(a), math.Float32bits(b))
							}
						}
					}
				}
			}
		}
	}
}

// TestTwoBoundaryBackwardsSum: flagging two backwards of one step as the
// boundary still sums both (in DeepSpeed ZeRO-1/2 the last one wins).
func TestTwoBoundaryBackwardsSum(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	for _, stage := range []int{1, 2, 3} {
		params := testParams(FP32)
		r := runSpec{stage: stage, world: 2, dtype: FP32, backwards: 2, steps: 2, streams: 2, bucket: 1024, predivide: 1, overlap: true, boundAll: true}
		data := makeWorkload(rng, r, params)
		res := runEngine(t, r, params, data, seed)
		checkMean(t, r, params, data, res)
	}
}

// TestCollectiveCounts: ZeRO-2/3 make one reduce-scatter per bucket per
// backward, ZeRO-1 one per bucket per step, with or without a boundary, and
// Step adds its one window check. The expected buckets, bytes and memory
// are worked out by hand from testParams, not from the plan under test.
func TestCollectiveCounts(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	// testParams in backward order: 1, 513, 64, 129, (0), 1000, 7, 300
	// elements of 2 bytes, cut at 512 bytes, padded to 4 ranks × 64.
	wantMembers := [][]int{{7}, {6}, {5, 4}, {2}, {1}, {0}}
	wantPadded := []int{256, 768, 256, 1024, 256, 512} // 3072 elements, 6144 bytes
	const nb, backwards = 6, 4
	for _, d := range []DType{BF16, FP16} {
		for _, stage := range []int{1, 2, 3} {
			for _, boundary := range []bool{false, true} {
				params := testParams(d)
				r := runSpec{stage: stage, world: 4, dtype: d, backwards: backwards, steps: 2, streams: 2, bucket: 512, predivide: 1, overlap: true, boundary: boundary}
				data := makeWorkload(rng, r, params)
				res := runEngine(t, r, params, data, seed)
				plan := res[0].plan
				for b, bp := range plan.Buckets {
					if b >= nb || !slices.Equal(bp.Params, wantMembers[b]) || bp.Padded != wantPadded[b] {
						t.Fatalf("%v: bucket %d holds %v padded to %d; want %v padded to %d", d, b, bp.Params, bp.Padded, wantMembers[b%nb], wantPadded[b%nb])
					}
				}
				if len(plan.Buckets) != nb {
					t.Fatalf("%v: %d buckets, want %d", d, len(plan.Buckets), nb)
				}
				reductions, payload, mem := int64(nb*backwards), int64(backwards*6144), int64(768*4+2*1024*2)
				if stage == 1 { // and a local fp32 accumulator per bucket: 2014 elements in all
					reductions, payload, mem = nb, 6144, mem+2014*4
				}
				for rank, rr := range res {
					for step, st := range rr.stats {
						c := st.Collectives
						where := fmt.Sprintf("%v stage %d boundary=%v rank %d step %d", d, stage, boundary, rank, step)
						if got := c[KindReduceScatter]; got != (CollectiveCount{reductions, payload, payload * 3 / 4}) {
							t.Errorf("%s: reduce-scatters %+v, want %d calls, %d payload bytes, %d on the wire", where, got, reductions, payload, payload*3/4)
						}
						if got := c[KindAllReduce]; got != (CollectiveCount{1, 8, 12}) {
							t.Errorf("%s: all-reduces %+v, want the window check alone: 1 call of 8 bytes, 12 on the wire", where, got)
						}
						if other := c.Total().Calls - c[KindReduceScatter].Calls - c[KindAllReduce].Calls; other != 0 {
							t.Errorf("%s: %d other collectives, want 0", where, other)
						}
						if st.Backwards != backwards {
							t.Errorf("%s: stats say %d backwards, want %d", where, st.Backwards, backwards)
						}
						if st.ReduceTime <= 0 {
							t.Errorf("%s: reduce time %v after %d reductions", where, st.ReduceTime, reductions)
						}
						// the fp32 shard, ZeRO-1's fp32 local sums, and two
						// staging buffers of the largest bucket (in order, the
						// pool never grows), all kept between windows
						if st.StagingBuffers != 2 || st.ResidentGradBytes != mem || st.PeakGradBytes != mem || st.PooledGradBytes != mem-768*4 {
							t.Errorf("%s: %d staging buffers, resident %d, peak %d bytes; want 2 and %d", where, st.StagingBuffers, st.ResidentGradBytes, st.PeakGradBytes, mem)
						}
					}
				}
			}
		}
	}
}

// TestProducerStreamRule: one bucket is filled from four streams, and a
// middle reporter's stream, drawn from the seed, is held by a gate. The
// reduction must wait for it (seed 002). The gate opens only once the
// engine's stream has settled, so a reduction that did not wait has run by
// then: with the wait narrowed to the last producer (or the first), the
// test sees a wrong sum every time.
func TestProducerStreamRule(t *testing.T) {
	params := []Param{{Count: 4096, DType: FP32}, {Count: 1000, DType: FP32}, {Count: 3000, DType: FP32}, {Count: 500, DType: FP32}}
	producerRule(t, params, NewLocalGroup, CPU(), func(e *Engine, p int, grad Tensor, s Stream, hold bool) (func(), error) {
		// The framework writes the gradient on its stream, after a gate
		// for the held one, and reports it at once.
		hs := s.(*HostStream)
		gate := make(chan struct{})
		if hold {
			if err := hs.Launch(func() error { <-gate; return nil }); err != nil {
				return nil, err
			}
		}
		g := make([]float32, grad.count)
		if err := hs.Launch(func() error { copy(g, grad.hostFloats()); return nil }); err != nil {
			return nil, err
		}
		_, err := e.GradReady(p, Float32s(g), s)
		return func() {
			settleBehind(t, e.reduceStream.(*HostStream), hs)
			close(gate)
		}, err
	})
}

// producerRule fills one ZeRO-2 bucket on 2 ranks, reporting each gradient
// through report, which writes it on stream s, one stream per gradient, and
// hands it to the engine. One middle reporter is held back (hold): after
// EndBackward the harness calls the release report returned for it. Waiting
// on every producer, the mean must be right; with the wait narrowed to the
// last producer, the test must see a wrong sum.
func producerRule(t *testing.T, params []Param, group func(int) ([]Comm, error), dev Device, report func(e *Engine, p int, grad Tensor, s Stream, hold bool) (release func(), err error)) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	r := runSpec{stage: 2, world: 2, dtype: FP32, backwards: 1, steps: 1}
	data := makeWorkload(rng, r, params)
	held := len(params) - 2 - rng.Intn(len(params)-2) // reported neither first nor last
	t.Logf("holding the stream of parameter %d", held)
	run := func(narrow bool) error {
		waitOnlyLastProducer = narrow
		defer func() { waitOnlyLastProducer = false }()
		comms, err := group(2)
		if err != nil {
			return err
		}
		res := make([][][]float32, 2)
		errs := eachRank(2, func(rank int) error {
			defer comms[rank].Close()
			e, err := New(Config{Stage: 2, BucketBytes: 64 << 20, Overlap: true}, comms[rank], params)
			if err != nil {
				return err
			}
			defer e.Close()
			var release func()
			for p := len(params) - 1; p >= 0; p-- {
				s, err := dev.NewStream()
				if err != nil {
					return err
				}
				defer s.Close()
				rel, err := report(e, p, data[0][0][rank][p].t, s, p == held)
				if err != nil {
					return err
				}
				if p == held {
					release = rel
				}
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
			if release != nil {
				release()
			}
			if err := e.Step(); err != nil {
				return err
			}
			res[rank], err = e.FullGrads()
			return err
		})
		for _, err := range errs {
			if err != nil {
				return err
			}
		}
		for p := range params {
			for i, got := range res[0][p] {
				want := (data[0][0][0][p].ref[i] + data[0][0][1][p].ref[i]) / 2
				if math.Abs(float64(got)-want) > 1e-6*(1+math.Abs(want)) {
					return fmt.Errorf("param %d[%d] = %g, want %g", p, i, got, want)
				}
			}
		}
		return nil
	}
	if err := run(false); err != nil {
		t.Fatalf("waiting on every producer stream: %v", err)
	}
	if err := run(true); err == nil {
		t.Fatal("with the wait narrowed to the last producer stream the sum was still right: the test cannot see the bug")
	} else {
		t.Logf("narrowed wait, as expected: %v", err)
	}
}

// TestCommDTypeFP32: bf16 and fp16 gradients reduced over an fp32 wire are
// as accurate as fp32 arithmetic allows.
func TestCommDTypeFP32(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	for _, stage := range []int{1, 2, 3} {
		for _, d := range []DType{BF16, FP16} {
			for _, world := range []int{2, 4} {
				params := testParams(d)
				r := runSpec{stage: stage, world: world, dtype: d, comm: FP32, backwards: 2, steps: 2, streams: 2, bucket: 512, predivide: 2, overlap: true}
				data := makeWorkload(rng, r, params)
				checkMean(t, r, params, data, runEngine(t, r, params, data, seed))
			}
		}
	}
}

// TestOverflowFlag: the accumulate pass flags an inf or NaN on the rank
// that owns it, and the flag clears at the next step.
func TestOverflowFlag(t *testing.T) {
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{false, true} {
			params := []Param{{Count: 256, DType: FP32}}
			comms, _ := NewLocalGroup(2)
			flags := make([][]bool, 2)
			errs := eachRank(2, func(rank int) error {
				e, err := New(Config{Stage: stage, BucketBytes: 1 << 20, Align: 1, Overlap: overlap}, comms[rank], params)
				if err != nil {
					return err
				}
				defer e.Close()
				s := NewHostStream()
				defer s.Close()
				for step := range 2 {
					g := make([]float32, 256)
					if step == 0 && rank == 0 {
						g[200] = float32(math.Inf(1)) // element 200 lives on rank 1's shard
					}
					if _, err := e.GradReady(0, Float32s(g), s); err != nil {
						return err
					}
					if err := e.EndBackward(); err != nil {
						return err
					}
					if err := e.Step(); err != nil {
						return err
					}
					flags[rank] = append(flags[rank], e.Stats().Overflow)
				}
				return nil
			})
			for _, err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			if flags[0][0] || !flags[1][0] || flags[0][1] || flags[1][1] {
				t.Errorf("stage %d overlap=%v: overflow flags %v, want rank 1 set on step 0 only", stage, overlap, flags)
			}
		}
	}
}

// TestStagingPoolGrows: when gradients arrive in an order that keeps more
// buckets open than the pool holds, the pool grows and the stats show it;
// in backward order it stays at two.
func TestStagingPoolGrows(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	params := testParams(FP32)
	r := runSpec{stage: 2, world: 2, dtype: FP32, backwards: 1, steps: 1, streams: 1, bucket: 256, predivide: 1, overlap: true}
	data := makeWorkload(rng, r, params)
	inOrder := runEngine(t, r, params, data, seed)
	if got := inOrder[0].stats[0].StagingBuffers; got != 2 {
		t.Errorf("backward order: %d staging buffers, want 2", got)
	}
	// Registration order is the reverse of backward order: every bucket
	// stays open until the last one completes.
	comms, _ := NewLocalGroup(1)
	e, err := New(Config{Stage: 2, BucketBytes: 256}, comms[0], params)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	for p := range params {
		if _, err := e.GradReady(p, data[0][0][0][p].t, s); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.EndBackward(); err != nil {
		t.Fatal(err)
	}
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
	if got, nb := e.Stats().StagingBuffers, len(e.Plan().Buckets); got != nb {
		t.Errorf("registration order: %d staging buffers, want one per bucket (%d)", got, nb)
	}
}

// TestRandomProtocol drives random sessions: each rank reports a random
// subset of the parameters in each backward (the others count as zero),
// in a random order, from random streams, with random boundary flags and a
// random number of backwards per step. Every step's full gradient must be
// the float64 mean of what was reported.
func TestRandomProtocol(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	for round := range 40 {
		world := 1 + rng.Intn(4)
		d := []DType{FP32, BF16, FP16}[rng.Intn(3)]
		params := testParams(d)
		cfg := Config{Stage: 1 + rng.Intn(3), BucketBytes: []int{200, 1000, 1 << 20}[rng.Intn(3)], Overlap: rng.Intn(2) == 0, Grads: GradPolicy{PredivideFactor: float64(1 + rng.Intn(world)), Reduction: Reduction(rng.Intn(2))}}
		if rng.Intn(2) == 0 {
			cfg.Grads.AccumSteps = 1 + rng.Intn(3) // fixed: every step takes that many
		}
		steps := 1 + rng.Intn(3)
		// plan[step][backward][rank][param]: reported or not
		type backward struct {
			boundary bool
			report   [][]bool
		}
		sessions := make([][]backward, steps)
		r := runSpec{stage: cfg.Stage, world: world, dtype: d, steps: steps, backwards: 3}
		data := makeWorkload(rng, r, params)
		for s := range sessions {
			g := cfg.Grads.AccumSteps
			if g == 0 {
				g = 1 + rng.Intn(3)
			}
			sessions[s] = make([]backward, g)
			for k := range sessions[s] {
				b := backward{boundary: rng.Intn(3) == 0, report: make([][]bool, world)}
				for rank := range b.report {
					b.report[rank] = make([]bool, len(params))
					for p := range params {
						b.report[rank][p] = rng.Intn(4) != 0
					}
				}
				sessions[s][k] = b
			}
		}
		comms, _ := NewLocalGroupTimeout(world, 20*time.Second)
		full := make([][][][]float32, world)
		errs := eachRank(world, func(rank int) error {
			e, err := New(cfg, comms[rank], params)
			if err != nil {
				return err
			}
			defer e.Close()
			streams := []Stream{NewHostStream(), NewHostStream()}
			for _, s := range streams {
				defer s.Close()
			}
			prng := rand.New(rand.NewSource(seed + int64(round*100+rank)))
			for s, sess := range sessions {
				for k, b := range sess {
					e.SetBoundary(b.boundary)
					for _, p := range prng.Perm(len(params)) {
						if b.report[rank][p] {
							if _, err := e.GradReady(p, data[s][k][rank][p].t, streams[prng.Intn(2)]); err != nil {
								return err
							}
						}
					}
					if err := e.EndBackward(); err != nil {
						return err
					}
				}
				if err := e.Step(); err != nil {
					return err
				}
				g, err := e.FullGrads()
				if err != nil {
					return err
				}
				full[rank] = append(full[rank], g)
			}
			return nil
		})
		for _, err := range errs {
			if err != nil {
				t.Fatalf("round %d %+v: %v", round, cfg, err)
			}
		}
		for s, sess := range sessions {
			rtol := float64(world+len(sess)+8) * (unitRoundoff(d) + unitRoundoff(FP32))
			for p, q := range params {
				for i := range q.Count {
					sum, mag := 0.0, 0.0
					for k, b := range sess {
						for rank := range world {
							if b.report[rank][p] {
								v := data[s][k][rank][p].ref[i]
								sum += v
								mag += math.Abs(v)
							}
						}
					}
					div := float64(world * len(sess))
					if cfg.Grads.Reduction == Sum {
						div = 1
					}
					want, tol := sum/div, rtol*mag/div+float64(world)*math.Ldexp(1, -24)
					for rank := range world {
						if got := float64(full[rank][s][p][i]); !(math.Abs(got-want) <= tol) {
							t.Fatalf("round %d %+v step %d rank %d: param %d[%d] = %g, want %g ± %g", round, cfg, s, rank, p, i, got, want, tol)
						}
					}
				}
			}
		}
	}
}

// settle waits until none of the streams can move on by itself: each is
// idle or blocked on an event that has not fired. A test that holds one
// stream with a gate calls it before opening the gate, so whatever the
// others would run without waiting for the gated work has run by then.
func settle(t testing.TB, streams ...Stream) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for _, s := range streams {
		hs := s.(*HostStream)
		for !hs.settled() {
			if time.Now().After(deadline) {
				t.Fatal("a stream did not settle within 20 s")
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
}

// settleBehind waits until s has run everything it can before gated opens:
// until it is idle, or waits on an event of gated. (Blocked on any other
// stream's event it may still have work to run: that stream will fire.)
func settleBehind(t testing.TB, s, gated *HostStream) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if w := s.blockedOn.Load(); w != nil && w.s == gated && w.s.done.Load() < w.seq {
			return
		}
		s.mu.Lock()
		idle := len(s.queue) == 0 && s.idle
		s.mu.Unlock()
		if idle {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("a stream did not settle within 20 s")
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// gateStream returns a host stream held by a task that runs when open is called.
func gateStream() (s *HostStream, open func()) {
	s = NewHostStream()
	gate := make(chan struct{})
	s.Launch(func() error { <-gate; return nil })
	var once sync.Once
	return s, func() { once.Do(func() { close(gate) }) }
}

// waitedOn reports whether a Sync waits on s's work now.
func (s *HostStream) waitedOn() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.syncers > 0
}

// TestReductionsOfABucketInOrder: two backwards report one bucket from two
// streams, the first while its stream is still held by earlier work. The
// second reduction (add) must not run before the first (copy), whatever
// stream each ran on: the shard is the mean of 1 and 3, not the first
// backward's 1/2 left by a copy that ran last.
func TestReductionsOfABucketInOrder(t *testing.T) {
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{false, true} {
			for _, boundary := range []bool{false, true} {
				comms, _ := NewLocalGroup(1)
				params := []Param{{Name: "w", Count: 256, DType: FP32}}
				e, err := New(Config{Stage: stage, BucketBytes: 1 << 20, Overlap: overlap, Grads: GradPolicy{AccumSteps: 2}}, comms[0], params)
				if err != nil {
					t.Fatal(err)
				}
				a, open := gateStream()
				b := NewHostStream()
				ones, threes := make([]float32, 256), make([]float32, 256)
				for i := range ones {
					ones[i], threes[i] = 1, 3
				}
				for _, step := range []struct {
					g []float32
					s Stream
				}{{ones, a}, {threes, b}} {
					e.SetBoundary(boundary)
					if _, err := e.GradReady(0, Float32s(step.g), step.s); err != nil {
						t.Fatal(err)
					}
					if err := e.EndBackward(); err != nil {
						t.Fatal(err)
					}
				}
				settle(t, b, e.reduceStream)
				open()
				if err := e.Step(); err != nil {
					t.Fatal(err)
				}
				full, err := e.FullGrads()
				if err != nil {
					t.Fatal(err)
				}
				for i, v := range full[0] {
					if v != 2 {
						t.Fatalf("stage %d overlap=%v boundary=%v: element %d = %g, want 2 (the mean of 1 and 3)", stage, overlap, boundary, i, v)
					}
				}
				e.Close()
				a.Close()
				b.Close()
			}
		}
	}
}

// with is v changed by edit: an optimizer made by its constructor with
// some fields set, in one expression.
func with[T any](v T, edit func(*T)) T {
	edit(&v)
	return v
}
