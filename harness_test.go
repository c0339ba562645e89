package zero

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand"
	randv2 "math/rand/v2"
	"os"
	"reflect"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// The tests' shared harness: seeds; running ranks (eachRank, onEngines, and
// runEngine and rankLoop over a runSpec and its workload); the small
// builders and checks that several test files use; stream gates; test
// buffers and the ISA levels of the host kernels; a small model with the
// state a step changes; the training runs; the estimator's runs against
// the allocations; the body of the offload benchmarks; and an engine's
// checkpointed state, read per rank and assembled per parameter (the
// checkpoint and safetensors tests). harness_cuda_test.go holds the part
// that names the CUDA device. A helper that only one test file uses stays
// in that file.

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

// ---- training runs -----------------------------------------------------------

// trainRun is one configuration of the equivalence test.
type trainRun struct {
	stage, world, backwards int
	dtype                   DType
	bucket                  int
	overlap                 bool
	offload                 bool
}

// trainEnv is where trainEngine runs: the group, the streams, and the
// parameters' and gradients' memory (the host's here, a GPU's in
// harness_cuda_test.go).
type trainEnv struct {
	group  func(world int) ([]Comm, error)
	stream func() (Stream, error)
	// place returns memory holding b's elements (written on s) and what
	// frees it once the engine is done with it.
	place func(s Stream, b *tbuf) (Tensor, func(), error)
	// fetch brings x's elements into b, the buffer x was placed from.
	fetch func(s Stream, x Tensor, b *tbuf) error
}

var hostTrain = trainEnv{
	group:  func(world int) ([]Comm, error) { return NewLocalGroupTimeout(world, 20*time.Second) },
	stream: func() (Stream, error) { return NewHostStream(), nil },
	place:  func(_ Stream, b *tbuf) (Tensor, func(), error) { return b.t(), func() {}, nil },
	fetch:  func(Stream, Tensor, *tbuf) error { return nil }, // b is x's memory
}

// trainEngine trains q on r.world in-process ranks and returns rank 0's
// parameters (as float64) and losses after every step, and every rank's
// final parameter bits.
func trainEngine(t *testing.T, q *quadTask, r trainRun, opt AdamW) (params [][]float64, final [][]uint32) {
	return trainEngineOn(t, hostTrain, q, r, opt)
}

func trainEngineOn(t *testing.T, env trainEnv, q *quadTask, r trainRun, opt AdamW) (params [][]float64, final [][]uint32) {
	t.Helper()
	steps := len(q.a)
	comms, err := env.group(r.world)
	if err != nil {
		t.Fatal(err)
	}
	final = make([][]uint32, r.world)
	params = make([][]float64, steps+1)
	errs := eachRank(r.world, func(rank int) error {
		defer comms[rank].Close()
		s0, err := env.stream()
		if err != nil {
			return err
		}
		defer s0.Close()
		s1, err := env.stream()
		if err != nil {
			return err
		}
		defer s1.Close()
		data := make([]*tbuf, len(q.sizes))
		mem := make([]Tensor, len(q.sizes))
		ps := make([]Param, len(q.sizes))
		off := 0
		for p, n := range q.sizes {
			data[p] = newTBuf(r.dtype, n)
			for i := range n {
				x := q.theta0[off+i]
				if rank > 0 {
					x = 100 // rank 0's values must win the broadcast
				}
				data[p].set(i, float32(x))
			}
			x, free, err := env.place(s0, data[p])
			if err != nil {
				return err
			}
			defer free()
			mem[p] = x
			ps[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: r.dtype, Data: x}
			off += n
		}
		if err := s0.Sync(); err != nil {
			return err
		}
		cfg := Config{Stage: r.stage, BucketBytes: r.bucket, Overlap: r.overlap, Optimizer: OptimizerPolicy{Groups: []Optimizer{opt}}, Offload: OffloadPolicy{Optimizer: r.offload}}
		e, err := New(cfg, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		read := func() []float64 {
			var out []float64
			for p, b := range data {
				if err := env.fetch(s0, mem[p], b); err != nil {
					t.Error(err)
				}
				for i := range b.len() {
					out = append(out, float64(b.val(i)))
				}
			}
			return out
		}
		if rank == 0 {
			params[0] = read()
		}
		var frees []func()
		for st := range steps {
			for k := range r.backwards {
				sample := k*r.world + rank
				theta := read()
				off := len(theta)
				for p := len(q.sizes) - 1; p >= 0; p-- { // backward order, two streams
					off -= q.sizes[p]
					g := newTBuf(r.dtype, q.sizes[p])
					for i := range q.sizes[p] {
						j := off + i
						d := float32(theta[j]) - float32(q.t[st][sample][j])
						g.set(i, float32(q.a[st][sample][j])*d)
					}
					s := []Stream{s0, s1}[p%2]
					x, free, err := env.place(s, g)
					if err != nil {
						return err
					}
					frees = append(frees, free)
					if _, err := e.GradReady(p, x, s); err != nil {
						return err
					}
				}
				if err := e.EndBackward(); err != nil {
					return err
				}
			}
			if err := e.Step(); err != nil {
				return err
			}
			for _, free := range frees { // Step has waited for the reductions
				free()
			}
			frees = frees[:0]
			if st := e.Stats(); st.Skipped {
				return fmt.Errorf("step skipped: norm %g", st.GradNorm)
			}
			if rank == 0 {
				params[st+1] = read()
			}
		}
		for p, b := range data {
			if err := env.fetch(s0, mem[p], b); err != nil {
				return err
			}
			for i := range b.len() {
				final[rank] = append(final[rank], b.bits(i))
			}
		}
		return nil
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("%+v rank %d: %v", r, rank, err)
		}
	}
	return params, final
}

// trainsAsCPU trains q with opt as cpu says on the host and as gpu says in
// env, and fails t unless every step's parameters have the same bits.
func trainsAsCPU(t *testing.T, env trainEnv, q *quadTask, opt AdamW, cpu, gpu trainRun) {
	t.Helper()
	cpuParams, cpuFinal := trainEngine(t, q, cpu, opt)
	gpuParams, gpuFinal := trainEngineOn(t, env, q, gpu, opt)
	for st := range cpuParams {
		for i, want := range cpuParams[st] {
			if got := gpuParams[st][i]; math.Float64bits(got) != math.Float64bits(want) {
				t.Fatalf("%+v step %d: element %d = %v on the GPU, %v on the CPU (%+v)", gpu, st, i, got, want, cpu)
			}
		}
	}
	for rank := range cpuFinal {
		if !slices.Equal(gpuFinal[rank], cpuFinal[rank]) {
			t.Fatalf("%+v: rank %d's final parameters differ from the CPU path's (%+v)", gpu, rank, cpu)
		}
	}
}

// z3Run is one configuration of the stage-3 trainer.
type z3Run struct {
	stage, world int
	dtype        DType
	bucket       int
	prefetch     int  // Config.PrefetchBytes
	live         int  // Config.LiveParamBytes
	sharded      bool // build with Param.Init instead of Data
	steps        int
	backwards    int  // per step (0: 1)
	window       bool // the step's backwards in a coalesced window
	overlap      bool
	clip         float64
	lossScale    LossScale
	offload      bool
	// offloadParams keeps stage 3's parameter shard in page-locked host
	// memory (Offload.Params)
	offloadParams bool
	// order gives the layers' forward order in a step (nil: 0, 1, 2, …)
	order func(step int) []int
	// check, if set, sees the parameter memory after every Gather and
	// Release on rank 0.
	check func(e *Engine, what string) error
}

// z3Result is what a run leaves: every rank's final parameters (bits, read
// through Gather at stage 3 and from their memory below it) and rank 0's
// stats after each step.
type z3Result struct {
	final [][]uint32
	stats []Stats
	state []ckptState // every rank's state tensors after the run
}

// trainZ3 trains q with AdamW as TestTrainingEquivalence does, reading the
// parameters layer by layer: at stage 3 each layer is gathered for its
// forward and released after it, and gathered again in backward (in reverse)
// while its gradient is computed; below stage 3 they are read from their
// memory.
func trainZ3(t *testing.T, q *quadTask, r z3Run) z3Result {
	t.Helper()
	comms, _ := NewLocalGroupTimeout(r.world, 20*time.Second)
	res := z3Result{final: make([][]uint32, r.world), state: make([]ckptState, r.world)}
	errs := eachRank(r.world, func(rank int) error {
		defer comms[rank].Close()
		n := len(q.sizes)
		data := make([]*tbuf, n)
		ps := make([]Param, n)
		offs := make([]int, n)
		off := 0
		for p, size := range q.sizes {
			offs[p] = off
			ps[p] = Param{Name: fmt.Sprint("w", p), Count: size, DType: r.dtype}
			if r.sharded {
				base := off
				ps[p].Init = func(dst []float32, at int) error {
					for i := range dst {
						dst[i] = float32(q.theta0[base+at+i])
					}
					return nil
				}
			} else {
				data[p] = newTBuf(r.dtype, size)
				for i := range size {
					x := q.theta0[off+i]
					if rank > 0 {
						x = 100 // rank 0's values must win the broadcast
					}
					data[p].set(i, float32(x))
				}
				ps[p].Data = data[p].t()
			}
			off += size
		}
		cfg := Config{Stage: r.stage, BucketBytes: r.bucket, Overlap: r.overlap, Precision: PrecisionPolicy{LossScale: r.lossScale}, Optimizer: OptimizerPolicy{Groups: []Optimizer{with(NewAdamW(0.01), func(o *AdamW) { o.WeightDecay = 0.01 })}, Clip: r.clip}, Params: ParamPolicy{PrefetchBytes: r.prefetch, LiveParamBytes: r.live}, Offload: OffloadPolicy{Optimizer: r.offload, Params: r.offloadParams}}
		e, err := New(cfg, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		if r.stage == 3 && !r.sharded {
			for _, b := range data { // the framework may free them: the engine must not read them again
				for i := range b.len() {
					b.set(i, float32(math.NaN()))
				}
			}
		}
		s := NewHostStream()
		defer s.Close()
		check := func(what string) error {
			if rank == 0 && r.check != nil {
				return r.check(e, what)
			}
			return nil
		}
		// read returns layer p's values as the forward sees them.
		read := func(p int) ([]float64, error) {
			out := make([]float64, q.sizes[p])
			if r.stage < 3 {
				for i := range out {
					out[i] = float64(data[p].val(i))
				}
				return out, nil
			}
			views, err := e.Gather(s, p)
			if err != nil {
				return nil, err
			}
			if err := check(fmt.Sprintf("gather %d", p)); err != nil {
				return nil, err
			}
			if err := s.Sync(); err != nil { // the host reads the view now
				return nil, err
			}
			v := &tbuf{dt: r.dtype}
			if r.dtype == FP32 {
				v.f = views[0].hostFloats()
			} else {
				v.h = unsafeHalfs(views[0])
			}
			for i := range out {
				out[i] = float64(v.val(i))
			}
			if err := e.Release(s, p); err != nil {
				return nil, err
			}
			return out, check(fmt.Sprintf("release %d", p))
		}
		for st := range r.steps {
			order := make([]int, n)
			for i := range order {
				order[i] = i
			}
			if r.order != nil {
				order = r.order(st)
			}
			if r.window {
				if err := e.BeginCoalesce(); err != nil {
					return err
				}
			}
			scale := float32(e.LossScale())
			for b := range max(r.backwards, 1) {
				for p := range order { // forward
					if _, err := read(order[p]); err != nil {
						return err
					}
				}
				sample := b*r.world + rank
				for k := len(order) - 1; k >= 0; k-- { // backward
					p := order[k]
					theta, err := read(p)
					if err != nil {
						return err
					}
					g := newTBuf(r.dtype, q.sizes[p])
					for i := range q.sizes[p] {
						j := offs[p] + i
						d := float32(theta[i]) - float32(q.t[st][sample][j])
						g.set(i, float32(q.a[st][sample][j])*d*scale)
					}
					if _, err := e.GradReady(p, g.t(), s); err != nil {
						return err
					}
				}
				if err := e.EndBackward(); err != nil {
					return err
				}
			}
			if r.window {
				if err := e.EndCoalesce(); err != nil {
					return err
				}
			}
			if err := e.Step(); err != nil {
				return err
			}
			if rank == 0 {
				res.stats = append(res.stats, e.Stats())
			}
		}
		for p := range n {
			theta, err := read(p)
			if err != nil {
				return err
			}
			for _, x := range theta {
				res.final[rank] = append(res.final[rank], refEncodeBits(r.dtype, float32(x)))
			}
		}
		res.state[rank], err = readCkptState(e)
		return err
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("%+v rank %d: %v", r, rank, err)
		}
	}
	return res
}

// optCase is a training run of a few fp32 or 16-bit parameters on 2
// ranks: grad gives the true (unscaled) gradient of element j of parameter
// p in backward k of step st on rank; the run hands it over times the
// engine's loss scale, as a trainer that scaled its loss would. before runs
// on every rank before each step's backwards (SetGroup, say).
type optCase struct {
	cfg       Config
	sizes     []int
	dt        DType
	init      func(p, j int) float32
	backwards int
	steps     int
	grad      func(st, k, rank, p, j int) float64
	before    func(e *Engine, st int) error
}

// optTrace is what an optCase run left: the fp32 master of every element
// after each step, put together from both ranks' shards, and each rank's
// stats per step.
type optTrace struct {
	master [][][]float64 // [step][param][element]
	stats  [2][]Stats
}

func runOpt(t *testing.T, c optCase) optTrace {
	t.Helper()
	tr := optTrace{master: make([][][]float64, c.steps)}
	for st := range tr.master {
		tr.master[st] = make([][]float64, len(c.sizes))
		for p, n := range c.sizes {
			tr.master[st][p] = make([]float64, n)
		}
	}
	comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
	errs := eachRank(2, func(rank int) error {
		ps := make([]Param, len(c.sizes))
		for p, n := range c.sizes {
			b := newTBuf(c.dt, n)
			for j := range n {
				b.set(j, c.init(p, j))
			}
			ps[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: c.dt, Data: b.t(), Group: min(p, len(c.cfg.Optimizer.Groups)-1)}
		}
		e, err := New(c.cfg, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		for st := range c.steps {
			if c.before != nil {
				if err := c.before(e, st); err != nil {
					return err
				}
			}
			for k := range c.backwards {
				scale := e.LossScale()
				for p := len(ps) - 1; p >= 0; p-- {
					g := newTBuf(c.dt, ps[p].Count)
					for j := range g.len() {
						g.set(j, float32(c.grad(st, k, rank, p, j)*scale))
					}
					if _, err := e.GradReady(p, g.t(), s); err != nil {
						return err
					}
				}
				if err := e.EndBackward(); err != nil {
					return err
				}
			}
			if err := e.Step(); err != nil {
				return err
			}
			tr.stats[rank] = append(tr.stats[rank], e.Stats())
			master := e.opt.master.hostFloats()
			for p := range ps {
				rg := e.plan.shardRange(p, rank)
				for i := range rg.Count {
					tr.master[st][p][rg.ParamOffset+i] = float64(master[rg.ShardOffset+i])
				}
			}
		}
		return nil
	})
	everyRankIs(t, "optimizer run", errs, nil)
	return tr
}

// memoryRun trains one AdamW step of a model of layers × (hidden² weight +
// hidden bias) in bf16 on world ranks and returns rank 0's stats and plan.
func memoryRun(t testing.TB, stage, world, layers, hidden, bucket int) (Stats, *Plan) {
	var params []Param
	for l := range layers {
		w, bias := newTBuf(BF16, hidden*hidden), newTBuf(BF16, hidden)
		params = append(params, Param{Name: fmt.Sprint("w", l), Count: hidden * hidden, DType: BF16, Data: w.t()},
			Param{Name: fmt.Sprint("b", l), Count: hidden, DType: BF16, Data: bias.t()})
	}
	comms, _ := NewLocalGroupTimeout(world, 20*time.Second)
	var stats Stats
	var plan *Plan
	errs := eachRank(world, func(rank int) error {
		defer comms[rank].Close()
		e, err := New(Config{Stage: stage, BucketBytes: bucket, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}, comms[rank], params)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		for p := len(params) - 1; p >= 0; p-- {
			g := newTBuf(BF16, params[p].Count)
			for i := range g.len() {
				g.set(i, 0.01)
			}
			if _, err := e.GradReady(p, g.t(), s); err != nil {
				return err
			}
			if err := s.Sync(); err != nil { // g is reused by nobody, but keep it alive
				return err
			}
		}
		if err := e.EndBackward(); err != nil {
			return err
		}
		if err := e.Step(); err != nil {
			return err
		}
		if rank == 0 {
			stats, plan = e.Stats(), e.Plan()
		}
		return nil
	})
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	return stats, plan
}

// ---- the estimator against the allocations ------------------------------------

// estimateModel is a small model of dtype dt: tiny buckets split it into
// many, some parameters larger than a bucket, one empty and one frozen;
// gathered (at stage 3) in sets of two, as a framework gathers a layer.
func estimateModel(dt DType) ([]Param, [][]int) {
	sizes := []int{300, 7, 1000, 0, 129, 64, 513, 1, 50}
	params := make([]Param, len(sizes))
	for i, n := range sizes {
		params[i] = Param{Name: fmt.Sprintf("p%d", i), Count: n, DType: dt, Data: newTBuf(dt, n).t()}
	}
	params[8].Frozen = true
	return params, [][]int{{0, 1}, {2, 3}, {4, 5}, {6, 7}}
}

// paramBudgets are stage 3's gather budgets at the test's bucket sizes: the
// default prefetch (a bucket's bytes ahead), none, and a prefetch of two
// largest buckets capped by LiveParamBytes at three.
var paramBudgets = []ParamPolicy{{}, {PrefetchBytes: -1}, {PrefetchBytes: 4096, LiveParamBytes: 3 * 2048}}

// estimateCase is one configuration of the estimator's tests and how it is
// driven.
type estimateCase struct {
	cfg   Config
	world int
	run   Run
}

func (c estimateCase) String() string {
	p, pp := c.cfg.Precision, c.cfg.Params
	return fmt.Sprintf("stage %d W=%d offload %+v window %v budget %d window %v shard %v comm %v backwards %d prefetch %d live %d opt %T",
		c.cfg.Stage, c.world, c.cfg.Offload, c.run.Window, c.cfg.Window.BudgetBytes, c.cfg.Window.DType, p.ShardDType, p.CommDType,
		c.run.Backwards, pp.PrefetchBytes, pp.LiveParamBytes, c.cfg.Optimizer.Groups)
}

// measured is what one rank's engine really held and moved.
type measured struct {
	device, host int          // high-water marks of the counting device
	live, allocs int          // device bytes and allocations live after the last Step
	before, at   []GPUMemory  // the device's own figures (NVML) before New and after the last Step
	wire         CommCounters // the last step's
	stats        Stats
	params       ParamMemory // stage 3's after the last Step
}

// measureEngine drives c on every rank of env's group, each rank's engine
// on the counting device newDev gives it, with its own copy of the
// parameters' values and its gradients placed by env: three steps of
// c.run.Backwards backwards (in a Coalesce window where c.run.Window), each
// backward handing over the gradients of c.run.Gathers' sets in reverse
// (nil: every parameter alone), at stage 3 each set gathered for the
// forward and again for the backward.
func measureEngine(t *testing.T, env trainEnv, newDev func(rank int) *countingDevice, c estimateCase, params []Param, seed int64) []measured {
	t.Helper()
	comms, err := env.group(c.world)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]measured, c.world)
	errs := eachRank(c.world, func(rank int) (err error) {
		defer comms[rank].Close()
		dev := newDev(rank)
		defer dev.release()
		s, err := env.stream()
		if err != nil {
			return err
		}
		defer s.Close()
		rng := rand.New(rand.NewSource(seed + int64(rank)))
		var frees []func()
		defer func() {
			if serr := s.Sync(); err == nil {
				err = serr
			}
			for _, f := range frees {
				f()
			}
		}()
		place := func(dt DType, n int, scale float64) (Tensor, error) {
			b := newTBuf(dt, n)
			for i := range b.len() {
				b.set(i, float32(scale*rng.NormFloat64()))
			}
			x, free, err := env.place(s, b)
			if err == nil {
				frees = append(frees, free)
			}
			return x, err
		}
		mine := append([]Param(nil), params...)
		grads := make([]Tensor, len(params))
		for p, q := range params {
			if q.Data.ptr != 0 {
				if mine[p].Data, err = place(q.DType, q.Count, 1); err != nil {
					return err
				}
			}
			if grads[p], err = place(q.DType, q.Count, 1); err != nil {
				return err
			}
		}
		if err := s.Sync(); err != nil {
			return err
		}
		out[rank].before = dev.memoryStats()
		e, err := New(c.cfg, onDevice{comms[rank], dev}, mine)
		if err != nil {
			return err
		}
		defer e.Close()
		stage3 := c.cfg.Stage == 3
		sets := c.run.Gathers
		if sets == nil { // one parameter at a time, as Run says
			for p, q := range params {
				if !q.Frozen {
					sets = append(sets, []int{p})
				}
			}
		}
		backward := func() error {
			for _, set := range sets {
				if stage3 {
					if _, err := e.Gather(s, set...); err != nil {
						return err
					}
					if err := e.Release(s, set...); err != nil {
						return err
					}
				}
			}
			for i := len(sets) - 1; i >= 0; i-- {
				if stage3 {
					if _, err := e.Gather(s, sets[i]...); err != nil {
						return err
					}
				}
				for j := len(sets[i]) - 1; j >= 0; j-- {
					p := sets[i][j]
					if _, err := e.GradReady(p, grads[p], s); err != nil {
						return err
					}
				}
				if stage3 {
					if err := e.Release(s, sets[i]...); err != nil {
						return err
					}
				}
			}
			return e.EndBackward()
		}
		for range 3 {
			steps := func() error {
				for range max(c.run.Backwards, 1) {
					if err := backward(); err != nil {
						return err
					}
				}
				return nil
			}
			if c.run.Window {
				err = e.Coalesce(steps)
			} else {
				err = steps()
			}
			if err == nil {
				err = e.Step()
			}
			if err != nil {
				return err
			}
		}
		if err := s.Sync(); err != nil {
			return err
		}
		m := &out[rank]
		m.at = e.DeviceMemory()
		m.live, m.allocs = dev.liveBytes(), dev.liveCount()
		m.params = e.ParamMemory()
		st := e.Stats()
		if err := e.Close(); err != nil {
			return err
		}
		m.device, m.host = dev.peaks()
		m.wire, m.stats = st.Collectives, st
		return nil
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("%v: rank %d: %v", c, rank, err)
		}
	}
	return out
}

// checkEstimateOn compares c's estimate with what measureEngine saw on
// every rank: device and host bytes to the byte, the engine's own Stats
// field by field (estimatedStats), the parameter shard's bytes on each
// side (ParamMemory), the collectives to the byte but for
// stage 3's gathers, where a prefetch that keeps a bucket from one ask to
// the next saves a gather the estimate counts. It returns the estimate and
// the measurements.
func checkEstimateOn(t *testing.T, env trainEnv, newDev func(rank int) *countingDevice, c estimateCase, params []Param, seed int64) (Estimation, []measured) {
	t.Helper()
	est, err := Estimate(params, c.cfg, c.world, c.run)
	if err != nil {
		t.Fatalf("%v: %v", c, err)
	}
	ms := measureEngine(t, env, newDev, c, params, seed)
	for rank, m := range ms {
		what := fmt.Sprintf("%v rank %d", c, rank)
		if got, want := int64(m.device), est.Device.Engine(); got != want {
			t.Errorf("%s: device high-water %d bytes, estimate %d (%+v)", what, got, want, est.Device)
		}
		if got, want := int64(m.host), est.Host.Total(); got != want {
			t.Errorf("%s: host high-water %d bytes, estimate %d (%+v)", what, got, want, est.Host)
		}
		if d := statsDiff(est.Stats(), m.stats); d != "" {
			t.Errorf("%s: the engine's Stats against the estimate's:%s\n(estimate %+v, %+v)", what, d, est.Device, est.Host)
		}
		// the parameter shard on the side the estimate puts it (with
		// Offload.Params the host's, the device holding none of it)
		if m.params.ShardBytes != est.Device.ParamShard || m.params.HostShardBytes != est.Host.ParamShard {
			t.Errorf("%s: parameter shard %d device bytes and %d host bytes; the estimate %d and %d", what,
				m.params.ShardBytes, m.params.HostShardBytes, est.Device.ParamShard, est.Host.ParamShard)
		}
		for k := range numKinds {
			got, want := m.wire[k], est.Wire[k]
			if k == KindAllGather && c.cfg.Stage == 3 && c.cfg.Params.PrefetchBytes >= 0 {
				// The prefetch keeps buckets gathered from one ask to the
				// next, saving gathers the estimate counts; it still
				// gathers every bucket a window asks for at least once.
				var floor CommCounters
				if len(c.cfg.Optimizer.Groups) > 0 {
					floor.add(KindAllGather, normWords*c.world*4, c.world) // the norm's
				}
				seen := map[int]bool{}
				for _, b := range setBuckets(est.Plan, params, c.run.Gathers) {
					if !seen[b] {
						seen[b] = true
						floor.add(KindAllGather, est.Plan.Buckets[b].Padded*est.Plan.modelDType().Size(), c.world)
					}
				}
				if got.Calls >= floor[k].Calls && got.Calls <= want.Calls && got.PayloadBytes >= floor[k].PayloadBytes && got.PayloadBytes <= want.PayloadBytes {
					continue
				}
			}
			if got != want {
				t.Errorf("%s: %v: %+v, estimate %+v", what, k, got, want)
			}
		}
	}
	return est, ms
}

// notEstimated are the memory fields of Stats that Estimation.Stats leaves
// out, with the reason.
var notEstimated = map[string]string{
	"HostPinnedBytes":      "what mlock accepts on the CPU device",
	"PeakGradBytesInUse":   "how many staging buffers are in use at once depends on the streams' timing",
	"WindowGradBytesInUse": "as PeakGradBytesInUse",
	"NormReadBytes":        "bytes read, not held",
}

// statsDiff lists every memory field of Stats (an int64 named ...Bytes)
// where got differs from est, the estimate's; empty when none does.
func statsDiff(est, got Stats) string {
	var out strings.Builder
	ev, gv := reflect.ValueOf(est), reflect.ValueOf(got)
	for i := range ev.NumField() {
		f := ev.Type().Field(i)
		if f.Type.Kind() != reflect.Int64 || !strings.HasSuffix(f.Name, "Bytes") || notEstimated[f.Name] != "" {
			continue
		}
		if e, g := ev.Field(i).Int(), gv.Field(i).Int(); e != g {
			fmt.Fprintf(&out, "\n\t%s %d, estimate %d (%+d)", f.Name, g, e, g-e)
		}
	}
	return out.String()
}

// ---- the offload benchmarks ----------------------------------------------------

// offloadBench is a model and a backward for benchOffloadStep: layers ×
// (hidden² + hidden) bf16 parameters on world ranks of group; param makes a
// parameter's memory, backward enqueues on s the compute that writes layer
// gradient p's n elements and returns them; setup (optional) runs for every
// rank and parameter before the ranks start.
type offloadBench struct {
	world, layers, hidden, backwards int
	group                            func(n int) ([]Comm, error)
	stream                           func() (Stream, error)
	param                            func(n int) (Tensor, error)
	backward                         func(s Stream, rank, k, p, n int) (Tensor, error)
	setup                            func(rank, p, n int)
}

// benchOffloadStep times ZeRO-2 AdamW steps of m without and with offload
// and reports the metrics that BenchmarkOffloadStep (bench_test.go) lists.
func benchOffloadStep(b *testing.B, m offloadBench) {
	var params []Param
	for range m.layers {
		params = append(params, Param{Count: m.hidden * m.hidden, DType: BF16}, Param{Count: m.hidden, DType: BF16})
	}
	for _, offload := range []bool{false, true} {
		b.Run(fmt.Sprintf("offload=%v", offload), func(b *testing.B) {
			comms, err := m.group(m.world)
			if err != nil {
				b.Fatal(err)
			}
			engines := make([]*Engine, m.world)
			streams := make([]Stream, m.world)
			cfgs := make([][]Param, m.world)
			for r := range m.world {
				cfgs[r] = append([]Param(nil), params...)
				for p := range cfgs[r] {
					if cfgs[r][p].Data, err = m.param(params[p].Count); err != nil {
						b.Fatal(err)
					}
					if m.setup != nil {
						m.setup(r, p, params[p].Count)
					}
				}
			}
			var wg sync.WaitGroup
			for r := range m.world {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var err error
					// a layer (weight and bias) a bucket
					engines[r], err = New(Config{Stage: 2, BucketBytes: (m.hidden*m.hidden + m.hidden) * 2, Overlap: true, Optimizer: OptimizerPolicy{Groups: []Optimizer{with(NewAdamW(1e-4), func(o *AdamW) { o.WeightDecay = 0.01 })}}, Offload: OffloadPolicy{Optimizer: offload}}, comms[r], cfgs[r])
					if err == nil {
						streams[r], err = m.stream()
					}
					if err != nil {
						b.Error(err)
					}
				}()
			}
			wg.Wait()
			defer func() {
				for r := range m.world {
					if engines[r] != nil {
						engines[r].Close()
					}
					if streams[r] != nil {
						streams[r].Close()
					}
					comms[r].Close()
				}
			}()
			if b.Failed() {
				return
			}
			step := func() {
				for r := range m.world {
					wg.Add(1)
					go func() {
						defer wg.Done()
						e, s := engines[r], streams[r]
						for k := range m.backwards {
							for p := len(params) - 1; p >= 0; p-- {
								g, err := m.backward(s, r, k, p, params[p].Count)
								if err == nil {
									_, err = e.GradReady(p, g, s)
								}
								if err != nil {
									b.Error(err)
									return
								}
							}
							if err := e.EndBackward(); err != nil {
								b.Error(err)
								return
							}
						}
						if err := e.Step(); err != nil {
							b.Error(err)
						}
					}()
				}
				wg.Wait()
			}
			step() // the first step allocates the moments
			var opt, gradCopy, exposed, paramCopy time.Duration
			b.ResetTimer()
			start := time.Now()
			for range b.N {
				step()
				st := engines[0].Stats()
				opt += st.OptimizerTime
				gradCopy += st.GradCopyTime
				exposed += st.GradCopyExposed
				paramCopy += st.ParamCopyTime
			}
			elapsed := time.Since(start)
			b.StopTimer()
			if b.Failed() {
				return
			}
			n := float64(b.N)
			shard := engines[0].Plan().ShardElems
			b.ReportMetric(elapsed.Seconds()*1e3/n, "step_ms")
			b.ReportMetric(opt.Seconds()*1e3/n, "optimizer_ms")
			b.ReportMetric(30*float64(shard)*n/opt.Seconds()/1e9, "adamw-GB/s")
			if offload || engines[0].dev == CPU() {
				b.ReportMetric(30*float64(shard)/yardOptSeconds(shard, m.world)/1e9, "yard-GB/s")
			}
			if offload {
				st := engines[0].Stats()
				b.ReportMetric(gradCopy.Seconds()*1e3/n, "grad_copy_ms")
				b.ReportMetric(1-float64(exposed)/float64(gradCopy), "copy_hidden")
				b.ReportMetric(paramCopy.Seconds()*1e3/n, "param_copy_ms")
				// the copies' speed: every backward lands each bucket's
				// reduced part (the shard, in the bf16 wire dtype); the step
				// sends the shard's new bf16 parameters back (its padding,
				// under 64 elements a bucket, counted too)
				wire := float64(m.backwards*shard*BF16.Size()) * n
				b.ReportMetric(wire/gradCopy.Seconds()/1e9, "grad_copy-GB/s")
				b.ReportMetric(float64(shard*BF16.Size())*n/paramCopy.Seconds()/1e9, "param_copy-GB/s")
				b.ReportMetric(float64(st.HostBytes)/(1<<20), "host_MiB")
				b.ReportMetric(float64(st.HostPinnedBytes)/float64(st.HostBytes), "pinned_share")
				b.ReportMetric(float64(st.DeviceBytesSaved)/(1<<20), "saved_MiB")
				b.ReportMetric(float64(len(engines[0].Plan().Buckets)), "buckets")
			}
		})
	}
}

// yardOptSeconds times yardOptPass over fresh fp32 buffers of n elements
// (p, g, m, v, staggered by 4 KiB + 64 B) and a bf16 out, on both cores,
// for ranks ranks at once as the engines' passes run: the best of 3.
func yardOptSeconds(n, ranks int) float64 {
	const stagger = 1040
	all := make([][]float32, ranks)
	out := make([][]uint16, ranks)
	for r := range ranks {
		all[r], out[r] = make([]float32, 4*(n+stagger)), make([]uint16, n)
	}
	best := math.Inf(1)
	for range 3 {
		t0 := time.Now()
		var wg sync.WaitGroup
		for r := range ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				at := func(k int) uintptr { return uintptr(unsafe.Pointer(&all[r][k*(n+stagger)])) }
				parallelRange(n, func(lo, hi int) {
					yardstick(yardOptPass, uintptr(unsafe.Pointer(&out[r][0])), at(0), at(1), at(2), at(3), lo, hi)
				})
			}()
		}
		wg.Wait()
		best = min(best, time.Since(t0).Seconds())
	}
	runtime.KeepAlive(all)
	runtime.KeepAlive(out)
	return best
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

// ---- the norm and the local sums, run with an optimizer --------------------

// normWay is one way a step's backwards run, and whether it tells the
// engine which landing is the last.
type normWay struct {
	name  string
	accum int                                          // Grads.AccumSteps
	run   func(e *Engine, backward func() error) error // three backwards
}

var normWays = []normWay{
	{name: "unknown", run: func(e *Engine, bw func() error) error { return repeatErr(3, bw) }},
	{name: "accumsteps", accum: 3, run: func(e *Engine, bw func() error) error { return repeatErr(3, bw) }},
	{name: "boundary", run: func(e *Engine, bw func() error) error {
		return errors.Join(repeatErr(2, bw), func() error { e.SetBoundary(true); return bw() }())
	}},
	{name: "boundary-early", run: func(e *Engine, bw func() error) error { // a backward after the boundary
		return errors.Join(bw(), func() error { e.SetBoundary(true); return bw() }(), bw())
	}},
	{name: "coalesce", run: func(e *Engine, bw func() error) error {
		if err := e.BeginCoalesce(); err != nil {
			return err
		}
		return errors.Join(repeatErr(3, bw), e.EndCoalesce())
	}},
	{name: "nosync", run: func(e *Engine, bw func() error) error {
		if err := e.BeginNoSync(); err != nil {
			return err
		}
		return errors.Join(repeatErr(2, bw), e.EndNoSync(), bw())
	}},
}

func repeatErr(n int, fn func() error) error {
	for range n {
		if err := fn(); err != nil {
			return err
		}
	}
	return nil
}

// normRun is what a normWay's run left on each rank after each step.
type normRun struct {
	master [2][][]uint32 // per step, the fp32 master shard's bits
	norm   [2][]uint64   // per step, GradNorm's bits
	read   [2][]int64    // per step, NormReadBytes
	shard  [2]int64      // the gradient shard's bytes
}

// normData is a run's data: the parameters' bf16 bits, and the gradients'
// per rank, step, backward and parameter.
type normData struct {
	sizes  []int
	params [][]uint16
	grads  [2][2][3][][]uint16
}

func makeNormData(seed int64) normData {
	rng := rand.New(rand.NewSource(seed))
	d := normData{sizes: []int{20000, 3000, 50001, 700}}
	bits := func(n int, scale func() float64) []uint16 {
		b := newTBuf(BF16, n)
		for j := range n {
			b.set(j, float32(rng.NormFloat64()*scale()))
		}
		return b.h
	}
	for _, n := range d.sizes {
		d.params = append(d.params, bits(n, func() float64 { return 1 }))
	}
	for rank := range d.grads {
		for st := range d.grads[rank] {
			for k := range d.grads[rank][st] {
				for _, n := range d.sizes {
					d.grads[rank][st][k] = append(d.grads[rank][st][k], bits(n, func() float64 { return math.Exp2(float64(rng.Intn(7) - 3)) }))
				}
			}
		}
	}
	return d
}

func runNormWay(t *testing.T, d normData, stage int, offload bool, shardDType DType, way normWay, fused bool) normRun {
	t.Helper()
	return runNormWayIn(t, d, stage, offload, shardDType, FP32, way, fused)
}

// runNormWayIn is runNormWay with the local sums in windowDType.
func runNormWayIn(t *testing.T, d normData, stage int, offload bool, shardDType, windowDType DType, way normWay, fused bool) normRun {
	t.Helper()
	normInLanding = fused
	defer func() { normInLanding = true }()
	var out normRun
	comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
	errs := eachRank(2, func(rank int) error {
		defer comms[rank].Close()
		ps := make([]Param, len(d.sizes))
		for p, n := range d.sizes {
			ps[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: BF16, Data: Halfs(slices.Clone(d.params[p]), BF16)}
		}
		cfg := Config{Stage: stage, BucketBytes: 64 << 10, Precision: PrecisionPolicy{ShardDType: shardDType}, Window: WindowPolicy{DType: windowDType},
			Grads: GradPolicy{AccumSteps: way.accum}, Offload: OffloadPolicy{Optimizer: offload},
			Optimizer: OptimizerPolicy{Clip: 1e-3, Groups: []Optimizer{NewAdamW(1e-2)}}}
		e, err := New(cfg, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		s := NewHostStream()
		defer s.Close()
		for st := range d.grads[rank] {
			k := 0
			backward := func() error {
				if err := forward(e, s); err != nil {
					return err
				}
				for p := len(ps) - 1; p >= 0; p-- {
					if _, err := e.GradReady(p, Halfs(d.grads[rank][st][k][p], BF16), s); err != nil {
						return err
					}
				}
				k++
				return e.EndBackward()
			}
			if err := way.run(e, backward); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
			stats := e.Stats()
			out.master[rank] = append(out.master[rank], f32bits(e.opt.master.hostFloats()))
			out.norm[rank] = append(out.norm[rank], math.Float64bits(stats.GradNorm))
			out.read[rank] = append(out.read[rank], stats.NormReadBytes)
			out.shard[rank] = int64(e.pl.gradShard().Bytes())
		}
		return nil
	})
	everyRankIs(t, fmt.Sprintf("stage %d offload %v shard %v %s fused %v", stage, offload, shardDType, way.name, fused), errs, nil)
	return out
}

// errTableParams, oneRank, stillWorks and twoRanks serve the tests of
// errors: the error table and the slips.

var errTableParams = []Param{{Name: "w", Count: 300, DType: FP32}, {Name: "b", Count: 40, DType: FP32}}

// oneRank is a one-rank engine over errTableParams and a stream.
func oneRank(t *testing.T, cfg Config) (*Engine, *HostStream) {
	t.Helper()
	comms, _ := NewLocalGroup(1)
	e, err := New(cfg, comms[0], errTableParams)
	if err != nil {
		t.Fatal(err)
	}
	s := NewHostStream()
	t.Cleanup(func() { e.Close(); s.Close() })
	return e, s
}

// stillWorks takes a backward of ones and a Step, and wants the mean 1.
func stillWorks(t *testing.T, e *Engine, s Stream) {
	t.Helper()
	if err := backward(e, s, constGrads(errTableParams, 1)); err != nil {
		t.Fatalf("the engine should go on: %v", err)
	}
	if err := e.Step(); err != nil {
		t.Fatalf("the engine should go on: %v", err)
	}
	full, err := e.FullGrads()
	if err != nil {
		t.Fatal(err)
	}
	if err := wantAll(full, 1); err != nil {
		t.Fatal(err)
	}
}

// twoRanks runs fn on two ranks of a group with the given timeout; the
// comms are not closed when fn returns.
func twoRanks(timeout time.Duration, cfg Config, fn func(e *Engine, s *HostStream) error) []error {
	return onEngines(2, timeout, cfg, errTableParams, fn)
}

// ---- the parameter offload benchmarks ---------------------------------------------

// layerParams is a model of layers bf16 weights of hidden² each: seed
// 000's at 8 × 4096 (134M parameters, a layer a 32 MiB bucket).
func layerParams(layers, hidden int) []Param {
	ps := make([]Param, layers)
	for i := range ps {
		ps[i] = Param{Name: fmt.Sprintf("layer%d.weight", i), Count: hidden * hidden, DType: BF16}
	}
	return ps
}

// benchParamOffloadStep times stage-3 AdamW steps of params on world ranks
// of env, with the parameter shard on the device and in page-locked host
// memory (Offload.Params), the optimizer on the device: each step takes
// backwards backwards, each layer gathered for its forward and released,
// then gathered again in backward (in reverse) while its gradient is
// handed over, and released. It reports per step the wall ms, the gathers'
// time (Stats.ParamGatherTime, copies included), and from rank 0's Stats
// the device bytes the engine holds (PeakParamBytes, PeakGradBytes,
// OptimizerBytes, ControlBytes), the parameter shard's on the device and
// on the host, and the host's page-locked bytes.
func benchParamOffloadStep(b *testing.B, env trainEnv, params []Param, world, backwards int) {
	for _, onHost := range []bool{false, true} {
		b.Run(fmt.Sprintf("offload-params=%v", onHost), func(b *testing.B) {
			comms, err := env.group(world)
			if err != nil {
				b.Fatal(err)
			}
			cfg := Config{Stage: 3, BucketBytes: 32 << 20, Overlap: true, Offload: OffloadPolicy{Params: onHost},
				Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-4)}}}
			ready, start, done := make(chan error, world), make(chan struct{}), make(chan error, world)
			stats := make([]Stats, world)
			var wg sync.WaitGroup
			for rank := range world {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer comms[rank].Close()
					fail := func(err error) { ready <- err }
					s, err := env.stream()
					if err != nil {
						fail(err)
						return
					}
					defer s.Close()
					ps := append([]Param(nil), params...)
					grads := make([]Tensor, len(ps))
					for p, q := range ps {
						w, g := newTBuf(q.DType, q.Count), newTBuf(q.DType, q.Count)
						for i := range g.len() {
							w.set(i, float32(i%251)/251-0.5)
							g.set(i, float32(i%7)/64-0.05)
						}
						var freeW, freeG func()
						if ps[p].Data, freeW, err = env.place(s, w); err == nil {
							defer freeW()
							grads[p], freeG, err = env.place(s, g)
						}
						if err != nil {
							fail(err)
							return
						}
						defer freeG()
					}
					if err := s.Sync(); err != nil {
						fail(err)
						return
					}
					e, err := New(cfg, comms[rank], ps)
					if err != nil {
						fail(err)
						return
					}
					defer e.Close()
					gather := func(p int) error {
						if _, err := e.Gather(s, p); err != nil {
							return err
						}
						return e.Release(s, p)
					}
					step := func() error {
						for range backwards {
							for p := range ps {
								if err := gather(p); err != nil {
									return err
								}
							}
							for p := len(ps) - 1; p >= 0; p-- {
								if _, err := e.Gather(s, p); err != nil {
									return err
								}
								if _, err := e.GradReady(p, grads[p], s); err != nil {
									return err
								}
								if err := e.Release(s, p); err != nil {
									return err
								}
							}
							if err := e.EndBackward(); err != nil {
								return err
							}
						}
						return e.Step()
					}
					if err := step(); err != nil { // the first step allocates the moments and learns the order
						fail(err)
						return
					}
					ready <- s.Sync()
					<-start
					var gathers time.Duration
					for range b.N {
						if err := step(); err != nil {
							done <- err
							return
						}
						gathers += e.Stats().ParamGatherTime
					}
					stats[rank] = e.Stats()
					stats[rank].ParamGatherTime = gathers / time.Duration(b.N)
					done <- s.Sync()
				}()
			}
			for range world {
				if err := <-ready; err != nil {
					close(start)
					wg.Wait()
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			t0 := time.Now()
			close(start)
			for range world {
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			}
			el := time.Since(t0)
			b.StopTimer()
			wg.Wait()
			st, mib := stats[0], func(x int64) float64 { return float64(x) / (1 << 20) }
			b.ReportMetric(float64(el.Microseconds())/1000/float64(b.N), "ms/step")
			b.ReportMetric(float64(st.ParamGatherTime.Microseconds())/1000, "gather-ms")
			b.ReportMetric(mib(st.PeakParamBytes+st.PeakGradBytes+st.OptimizerBytes+st.ControlBytes), "device-MiB")
			b.ReportMetric(mib(st.ParamShardBytes), "device-shard-MiB")
			b.ReportMetric(mib(st.HostParamBytes), "host-shard-MiB")
			b.ReportMetric(mib(st.HostBytes), "host-MiB")
		})
	}
}
