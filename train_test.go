package zero

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"testing"
	"time"
)

// The training runs that several test files compare: a model trained by
// the engine (on the host or, through trainEnv, a GPU) against the float64
// reference; ZeRO-3 runs; an optimizer's trace over steps; a memory run;
// the norm and the local sums run with an optimizer.

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

// trainEngine trains q on r.world in-process ranks and returns rank 0's
// parameters (as float64) and losses after every step, and every rank's
// final parameter bits.
func trainEngine(t *testing.T, q *quadTask, r trainRun, opt AdamW) (params [][]float64, final [][]uint32) {
	return trainEngineOn(t, hostTrain, q, r, opt)
}
