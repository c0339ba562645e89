package zero

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand"
	randv2 "math/rand/v2"
	"os"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// The tests' shared harness: seeds; running ranks (eachRank, onEngines,
// oneRank, twoRanks, and runEngine and rankLoop over a runSpec and its
// workload); the small builders and checks that several test files use;
// stream gates; test buffers and the ISA levels of the host kernels; a
// small model with the state a step changes; and an engine's checkpointed
// state, read per rank and assembled per parameter (the checkpoint,
// safetensors and fuzz tests). The training runs live in train_test.go,
// the estimator's runs in estimate_test.go, the benchmarks' bodies in
// benchenv_test.go; harness_cuda_test.go holds the part that names the
// CUDA device. A helper that only one test file uses stays in that file.

// ---- seeds -------------------------------------------------------------------

// testSeed gives fresh data every run; the seed is logged, and
// ZERO_TEST_SEED=n replays a run (as testRNG does for the kernel tests).
func testSeed(t testing.TB) int64 {
	t.Helper()
	return int64(seedFromEnv(t))
}

// seedFromEnv returns ZERO_TEST_SEED, or a fresh seed, and logs how to
// replay it.
func seedFromEnv(t testing.TB) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano()) &^ (1 << 63) // fits an int64 too
	if s := os.Getenv("ZERO_TEST_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("ZERO_TEST_SEED=%q: %v", s, err)
		}
		seed = v
	}
	t.Logf("seed %d (rerun with ZERO_TEST_SEED=%d)", seed, seed)
	return seed
}

// testRNG is the math/rand/v2 source of the kernel tests, seeded as
// testSeed is: fresh data every run, the seed logged, ZERO_TEST_SEED=n to
// replay.
func testRNG(t testing.TB) *randv2.Rand {
	t.Helper()
	seed := seedFromEnv(t)
	return randv2.New(randv2.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// ---- running ranks -----------------------------------------------------------

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

// within fails t unless fn returns within d (a hang is a bug too).
func within(t *testing.T, d time.Duration, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("did not return within %v", d)
	}
}

// onEngines builds an engine per rank of a fresh in-process group, runs fn
// on each rank's goroutine with a host stream, and returns the errors.
func onEngines(world int, timeout time.Duration, cfg Config, params []Param, fn func(e *Engine, s *HostStream) error) []error {
	comms, err := NewLocalGroupTimeout(world, timeout)
	if err != nil {
		return []error{err}
	}
	return eachRank(world, func(rank int) error {
		e, err := New(cfg, comms[rank], params)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		return fn(e, s)
	})
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
	shard       DType // Precision.ShardDType (0: fp32)
	offload     bool  // Config.Offload
	// poison writes junk into every view of the shard after each step's
	// reads: the next window's first reductions must copy over it.
	poison bool
}

func (r runSpec) String() string {
	return fmt.Sprintf("z%d/w%d/%v/ov=%v/b%d/n%d/f%g", r.stage, r.world, r.dtype, r.overlap, r.bucket, r.backwards, r.predivide)
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
	cfg := r.config()
	results := make([]rankResult, r.world)
	for rank, err := range eachRank(r.world, func(rank int) error { return run(cfg, rank, &results[rank]) }) {
		if err != nil {
			t.Fatalf("%v: rank %d: %v", r, rank, err)
		}
	}
	return results
}

// config is the engine's Config of r.
func (r runSpec) config() Config {
	return Config{Stage: r.stage, BucketBytes: r.bucket, Overlap: r.overlap, Precision: PrecisionPolicy{CommDType: r.comm, ShardDType: r.shard}, Grads: GradPolicy{PredivideFactor: r.predivide, AccumSteps: r.accum, Reduction: r.reduction}, Window: WindowPolicy{BudgetBytes: r.budget, DType: r.windowDType}, Offload: OffloadPolicy{Optimizer: r.offload}}
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

// ---- small builders and checks ----------------------------------------------

// backward reports every parameter of params from s and ends the backward.
func backward(e *Engine, s Stream, grads []Tensor) error {
	if err := forward(e, s); err != nil {
		return err
	}
	for p := len(grads) - 1; p >= 0; p-- {
		if _, err := e.GradReady(p, grads[p], s); err != nil {
			return err
		}
	}
	return e.EndBackward()
}

// forward is a stage-3 forward (nothing below stage 3, or without
// parameter memory): every parameter with a shard that no Gather named
// since the last Step gathered on s and released, as a framework's
// forward reads them. GradReady refuses a parameter no Gather named; a
// test that gathers by itself gets no gathers more.
func forward(e *Engine, s Stream) error {
	if e.ps == nil {
		return nil
	}
	var ids []int
	for p := range e.params {
		if !e.params[p].Frozen && e.ps.unasked(p) {
			ids = append(ids, p)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	if _, err := e.Gather(s, ids...); err != nil {
		return err
	}
	return e.Release(s, ids...)
}

// constGrads is one gradient per parameter, every element v.
func constGrads(params []Param, v float32) []Tensor {
	out := make([]Tensor, len(params))
	for p, q := range params {
		x := make([]float32, q.Count)
		for i := range x {
			x[i] = v
		}
		out[p] = Float32s(x)
	}
	return out
}

// bf16Grads is one bf16 gradient per parameter, every element v (exact in
// bf16).
func bf16Grads(params []Param, v float32) []Tensor {
	out := make([]Tensor, len(params))
	for p, q := range params {
		x := make([]uint16, q.Count)
		for i := range x {
			x[i] = uint16(refEncode(BF16, v))
		}
		out[p] = Halfs(x, BF16)
	}
	return out
}

// wantAll checks that every element of every parameter's full gradient is want.
func wantAll(full [][]float32, want float32) error {
	for p, g := range full {
		for i, v := range g {
			if v != want {
				return fmt.Errorf("param %d[%d] = %g, want %g", p, i, v, want)
			}
		}
	}
	return nil
}

func everyRankIs(t *testing.T, what string, errs []error, want error) {
	t.Helper()
	for r, err := range errs {
		if !errors.Is(err, want) {
			t.Errorf("%s: rank %d: %v, want %v", what, r, err, want)
		}
	}
}

// with is v changed by edit: an optimizer made by its constructor with
// some fields set, in one expression.
func with[T any](v T, edit func(*T)) T {
	edit(&v)
	return v
}

// closeTo fails t unless got is within rel·|want| + abs of want.
func closeTo(t *testing.T, what string, got, want, rel, abs float64) {
	t.Helper()
	if d := math.Abs(got - want); !(d <= rel*math.Abs(want)+abs) {
		t.Fatalf("%s = %.9g, want %.9g (|diff| %.3g > %.3g)", what, got, want, d, rel*math.Abs(want)+abs)
	}
}

// sameShards reports the first step, rank and element where two runs'
// shards differ in their bits.
func sameShards(a, b []rankResult) error {
	for rank := range a {
		for st := range a[rank].shard {
			for i, x := range a[rank].shard[st] {
				if y := b[rank].shard[st][i]; math.Float32bits(x) != math.Float32bits(y) {
					return fmt.Errorf("rank %d step %d: shard[%d] = %x, want %x", rank, st, i, math.Float32bits(y), math.Float32bits(x))
				}
			}
		}
	}
	return nil
}

// ---- stream gates ------------------------------------------------------------

// settle waits until none of the streams can move on by itself: each is
// idle or blocked on an event that has not fired. A test that holds one
// stream with a gate calls it before opening the gate, so whatever the
// others would run without waiting for the gated work has run by then.
//
// All of them at once: a stream found blocked on another's event is
// released when that one gets there, so one pass in which each is settled
// proves nothing if any of them, or of the streams they wait on, moved
// meanwhile. settle returns after a pass that every stream passes with no
// such stream having moved (its count of finished items unchanged).
func settle(t testing.TB, streams ...Stream) {
	t.Helper()
	hs := make([]*HostStream, len(streams))
	for i, s := range streams {
		hs[i] = s.(*HostStream)
	}
	// progress is each stream's finished items, and those of the streams
	// they are blocked on
	progress := func() map[*HostStream]uint64 {
		at := map[*HostStream]uint64{}
		for _, s := range hs {
			at[s] = s.done.Load()
			if w := s.blockedOn.Load(); w != nil {
				at[w.s] = w.s.done.Load()
			}
		}
		return at
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		before := progress()
		all := true
		for _, s := range hs {
			all = all && s.settled()
		}
		if all && maps.Equal(before, progress()) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the streams did not settle within 20 s")
		}
		time.Sleep(50 * time.Microsecond)
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

// ---- test buffers ------------------------------------------------------------

// tbuf is a host buffer of one dtype, allocated on the Go heap (the kernels
// take raw addresses, so it must not live on a goroutine stack, which moves).
type tbuf struct {
	dt DType
	f  []float32
	h  []uint16
}

//go:noinline
func newTBuf(dt DType, n int) *tbuf {
	b := &tbuf{dt: dt}
	if dt == FP32 {
		b.f = make([]float32, n+1) // +1: a valid address even when n == 0
		b.f = b.f[:n]
	} else {
		b.h = make([]uint16, n+1)
		b.h = b.h[:n]
	}
	return b
}

// t views the buffer as a tensor.
func (b *tbuf) t() Tensor {
	if b.dt == FP32 {
		return Float32s(b.f)
	}
	return Halfs(b.h, b.dt)
}

func (b *tbuf) len() int {
	if b.dt == FP32 {
		return len(b.f)
	}
	return len(b.h)
}

func (b *tbuf) ptr() uintptr {
	if b.dt == FP32 {
		return uintptr(unsafe.Pointer(unsafe.SliceData(b.f)))
	}
	return uintptr(unsafe.Pointer(unsafe.SliceData(b.h)))
}

func (b *tbuf) bits(i int) uint32 {
	if b.dt == FP32 {
		return math.Float32bits(b.f[i])
	}
	return uint32(b.h[i])
}

func (b *tbuf) setBits(i int, u uint32) {
	if b.dt == FP32 {
		b.f[i] = math.Float32frombits(u)
	} else {
		b.h[i] = uint16(u)
	}
}

func (b *tbuf) val(i int) float32 { return refDecode(b.dt, b.bits(i)) }

func (b *tbuf) set(i int, v float32) { b.setBits(i, refEncode(b.dt, v)) }

func (b *tbuf) clone() *tbuf {
	c := newTBuf(b.dt, b.len())
	copy(c.f, b.f)
	copy(c.h, b.h)
	return c
}

var allDTypes = []DType{FP32, BF16, FP16}

// unsafeHalfs copies out the elements of a 16-bit tensor in host memory
// (a view of the engine's own buffers, say), little-endian.
func unsafeHalfs(t Tensor) []uint16 {
	b := t.hostBytes()
	out := make([]uint16, t.count)
	for i := range out {
		out[i] = uint16(b[2*i]) | uint16(b[2*i+1])<<8
	}
	return out
}

// ---- ISA levels of the host kernels ------------------------------------------

// forEachLevel runs fn as a subtest at every ISA level of the host kernels
// that this machine supports (kernels.c compiles the hot loops for x86-64-v2,
// AVX2 and AVX-512), then restores the default.
//
// The largest inputs run only at the default (best) level, where the
// package runs; the other levels get smaller ones (fullSize reports which),
// and TestKernelLevelsAgree compares every level with the baseline bit for
// bit. Under the race detector only the best level runs, without the
// largest inputs: make test runs the full sweeps again without it.
func forEachLevel(t *testing.T, fn func(t *testing.T)) {
	best := setKernelLevel(-1)
	defer func() { setKernelLevel(-1); atLevelBest = true }()
	lowest := 0
	if raceEnabled {
		lowest = best // the levels differ in C only, which the race detector does not see
	}
	for l := lowest; l <= best; l++ {
		if got := setKernelLevel(l); got != l {
			t.Fatalf("setKernelLevel(%d) = %d", l, got)
		}
		atLevelBest = l == best
		t.Run(fmt.Sprintf("isa%d", l), fn)
	}
}

// withoutRace skips a test under the race detector: it checks C kernels
// against each other, or the source, none of which the race detector
// sees; make test runs it without the race detector.
func withoutRace(t *testing.T) {
	t.Helper()
	if raceEnabled {
		t.Skip("checks nothing the race detector sees; make test runs it without -race")
	}
}

// atLevelBest is false while forEachLevel runs a subtest below the best level.
var atLevelBest = true

// fullSize says whether a test should use its largest inputs (see
// forEachLevel): not under the race detector, whose cost is per element and
// which needs the parallel split once, not at every size.
func fullSize() bool { return atLevelBest && !testing.Short() && !raceEnabled }

// ---- a small model and the state a step changes ------------------------------

// smallModel is a model of three parameters with memory, one of them never
// reported when skip is set, and one frozen.
func smallModel(dt DType, value float32) ([]Param, []*tbuf) {
	sizes := []int{300, 7, 1000, 50}
	ps := make([]Param, len(sizes))
	bufs := make([]*tbuf, len(sizes))
	for i, n := range sizes {
		bufs[i] = newTBuf(dt, n)
		for j := range n {
			bufs[i].set(j, value+float32(j%7)/8)
		}
		ps[i] = Param{Name: fmt.Sprint("p", i), Count: n, DType: dt, Data: bufs[i].t()}
	}
	ps[3].Frozen = true
	return ps, bufs
}

// engineState is everything a step may change, bit for bit.
type engineState struct {
	master, m, v, params []uint32
	steps                []int
	scale                float64
}

func snapshotState(e *Engine, params []*tbuf) engineState {
	var st engineState
	read := func(t Tensor) []uint32 {
		if t.ptr == 0 {
			return nil
		}
		out := make([]uint32, t.count)
		for i, f := range t.hostFloats() {
			out[i] = math.Float32bits(f)
		}
		return out
	}
	st.master, st.m, st.v = read(e.opt.master), read(e.opt.m), read(e.opt.v)
	for _, p := range params {
		for i := range p.len() {
			st.params = append(st.params, p.bits(i))
		}
	}
	st.steps = slices.Clone(e.opt.steps)
	st.scale = e.opt.scaler.scale
	return st
}

func (a engineState) equal(b engineState) bool {
	return a.optimizerEqual(b) && slices.Equal(a.params, b.params)
}

// optimizerEqual compares the master, moments and step counts; a buffer
// not made yet equals one of zeros (SGD's momentum is made by the first
// step, and the step counts say it holds nothing yet).
func (a engineState) optimizerEqual(b engineState) bool {
	same := func(x, y []uint32) bool {
		if x == nil || y == nil {
			return !slices.ContainsFunc(x, func(u uint32) bool { return u != 0 }) &&
				!slices.ContainsFunc(y, func(u uint32) bool { return u != 0 })
		}
		return slices.Equal(x, y)
	}
	return same(a.master, b.master) && same(a.m, b.m) && same(a.v, b.v) && slices.Equal(a.steps, b.steps)
}

// ---- engine state, per rank and per parameter ---------------------------------

// ckptState is what a resumed run must reproduce, bit for bit: the state
// tensors in the rank's shard layout (plan), each of its dtype.
type ckptState struct {
	params [][]float32
	state  map[string][]byte
	dtypes map[string]DType
	plan   *Plan
	rank   int
	steps  []int
	scaler scalerState
	step   int
}

func readCkptState(e *Engine) (ckptState, error) {
	st := ckptState{state: map[string][]byte{}, dtypes: map[string]DType{}, plan: e.plan, rank: e.rank, steps: slices.Clone(e.opt.steps), step: e.stepIndex}
	c := e.opt.checkpointState()
	st.scaler = c.Scaler
	for _, s := range e.opt.stateTensors() {
		b := make([]byte, s.t.Bytes())
		if len(b) > 0 {
			if err := s.dev.copy(s.s, hostTensor(b, s.t.dtype), s.t); err != nil {
				return st, err
			}
			if err := s.s.Sync(); err != nil {
				return st, err
			}
		}
		st.state[s.name] = b
		st.dtypes[s.name] = s.t.dtype
	}
	var err error
	st.params, err = e.FullParams()
	return st, err
}

// consolidate assembles every state tensor of one run, parameter by
// parameter, from each rank's shard (states, one per rank, in rank
// order) by the plan's ranges: name → parameter → its bytes. Every
// element of a parameter must come from exactly one rank.
func consolidate(states []ckptState) (map[string][][]byte, error) {
	plan := states[0].plan
	out := map[string][][]byte{}
	for name, dt := range states[0].dtypes {
		size := dt.Size()
		full := make([][]byte, len(plan.counts))
		for p, n := range plan.counts {
			full[p] = make([]byte, n*size)
			if plan.ParamBucket[p] < 0 {
				continue // frozen or empty: no shard holds it
			}
			got := 0
			for r, st := range states {
				rg := plan.shardRange(p, r)
				if st.rank != r || st.plan != plan && st.plan.Fingerprint() != plan.Fingerprint() {
					return nil, fmt.Errorf("state %d is rank %d's of another plan", r, st.rank)
				}
				copy(full[p][rg.ParamOffset*size:], st.state[name][rg.ShardOffset*size:(rg.ShardOffset+rg.Count)*size])
				got += rg.Count
			}
			if got != n {
				return nil, fmt.Errorf("%s of parameter %d: the ranks hold %d of its %d elements", name, p, got, n)
			}
		}
		out[name] = full
	}
	return out, nil
}

func firstByteDiff(x, y []byte) int {
	if len(x) != len(y) {
		return min(len(x), len(y))
	}
	for i := range x {
		if x[i] != y[i] {
			return i
		}
	}
	return -1
}

// heapAllocated is the bytes the Go heap has handed out since the start:
// the difference over a call is what it allocated (every goroutine's).
// heapAllocs is runtime/metrics' /gc/heap/allocs:bytes: every byte the
// heap has allocated, cumulative (cheaper to read than MemStats).
func heapAllocs() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func heapAllocated() uint64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.TotalAlloc
}

// toDType rounds x into a host tensor of d.
func toDType(x []float32, d DType) Tensor {
	if d == FP32 {
		return Float32s(x)
	}
	h := make([]uint16, len(x))
	for i, v := range x {
		h[i] = uint16(refEncode(d, v))
	}
	return Halfs(h, d)
}

func f32bits(x []float32) []uint32 {
	out := make([]uint32, len(x))
	for i, v := range x {
		out[i] = math.Float32bits(v)
	}
	return out
}

// syncedCollective is zero's reduce-scatter (sum) or all-gather on s, and
// the stream's Sync.
func syncedCollective(c Comm, s Stream, kind CollectiveKind, send, recv Tensor) error {
	var err error
	if kind == KindReduceScatter {
		err = c.ReduceScatter(s, send, recv, OpSum)
	} else {
		err = c.AllGather(s, send, recv)
	}
	if err == nil {
		err = s.Sync()
	}
	return err
}
