package zero

import (
	"fmt"
	"math"
	"math/rand"
	"sync"
	"testing"
	"time"
)

// testSeed gives fresh data every run; the seed is logged so a failure can be replayed.
func testSeed(t testing.TB) int64 {
	s := time.Now().UnixNano()
	t.Logf("seed %d", s)
	return s
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
	accum     int // GradAccumSteps; 0 = backwards
	steps     int
	streams   int
	shuffle   bool
	boundary  bool // SetBoundary(true) before the last backward of a step
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
	cfg := Config{Stage: r.stage, BucketBytes: r.bucket, Overlap: r.overlap, CommDType: r.comm, PredivideFactor: r.predivide, GradAccumSteps: r.accum}
	if cfg.GradAccumSteps == 0 {
		cfg.GradAccumSteps = r.backwards
	}
	results := make([]rankResult, r.world)
	errs := make([]error, r.world)
	var wg sync.WaitGroup
	for rank := range r.world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[rank] = runRank(cfg, comms[rank], r, params, data, seed, &results[rank])
		}()
	}
	wg.Wait()
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("%v: rank %d: %v", r, rank, err)
		}
	}
	return results
}

func runRank(cfg Config, comm Comm, r runSpec, params []Param, data workload, seed int64, out *rankResult) error {
	defer comm.Close()
	e, err := New(cfg, comm, params)
	if err != nil {
		return err
	}
	defer e.Close()
	out.plan = e.Plan()
	streams := make([]Stream, max(r.streams, 1))
	for i := range streams {
		streams[i] = NewHostStream()
		defer streams[i].Close()
	}
	rng := rand.New(rand.NewSource(seed + int64(comm.Rank())))
	order := make([]int, len(params))
	for step := range r.steps {
		for k := range r.backwards {
			for i := range order {
				order[i] = len(params) - 1 - i
			}
			if r.shuffle {
				rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			}
			if r.boundary && k == r.backwards-1 {
				e.SetBoundary(true)
			}
			for i, p := range order {
				if _, err := e.GradReady(p, data[step][k][comm.Rank()][p].t, streams[i%len(streams)]); err != nil {
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
	}
	return nil
}

// unitRoundoff is half the gap between 1 and the next value of d.
func unitRoundoff(d DType) float64 {
	switch d {
	case BF16:
		return math.Ldexp(1, -8)
	case FP16:
		return math.Ldexp(1, -11)
	}
	return math.Ldexp(1, -24)
}

// checkMean compares every rank's shard and full gradient against the
// float64 mean (1/(W·G)) Σ_ranks Σ_backwards grad. The bound counts the
// roundings on the way: the cast to the wire dtype, the rank sum, the
// scales and the fp32 accumulation, each relative to Σ|grad|/(W·G).
func checkMean(t *testing.T, r runSpec, params []Param, data workload, res []rankResult) {
	t.Helper()
	g := r.accum
	if g == 0 {
		g = r.backwards
	}
	comm := r.comm
	if comm == 0 {
		comm = r.dtype
	}
	rtol := float64(r.world+r.backwards+6) * (unitRoundoff(comm) + unitRoundoff(FP32))
	atol := 0.0
	if comm == FP16 {
		atol = float64(r.world+r.backwards) * math.Ldexp(1, -24) / r.predivide
	}
	for step := range r.steps {
		mean := make([][]float64, len(params))
		mag := make([][]float64, len(params))
		for p, q := range params {
			mean[p] = make([]float64, q.Count)
			mag[p] = make([]float64, q.Count)
			for k := range r.backwards {
				for rank := range r.world {
					for i, v := range data[step][k][rank][p].ref {
						mean[p][i] += v
						mag[p][i] += math.Abs(v)
					}
				}
			}
			for i := range mean[p] {
				mean[p][i] /= float64(r.world * g)
				mag[p][i] /= float64(r.world * g)
			}
		}
		for rank, rr := range res {
			for p := range params {
				for i, got := range rr.full[step][p] {
					if d := math.Abs(float64(got) - mean[p][i]); !(d <= rtol*mag[p][i]+atol) {
						t.Fatalf("%v: step %d rank %d: full grad of param %d[%d] = %g, want %g (|diff| %g > %g)", r, step, rank, p, i, got, mean[p][i], d, rtol*mag[p][i]+atol)
					}
				}
			}
			// The shard is the rank's slice of every bucket; padding is zero.
			plan := rr.plan
			for b, bp := range plan.Buckets {
				for j := range bp.Shard {
					flat := rank*bp.Shard + j
					got := rr.shard[step][bp.ShardOffset+j]
					p, i := paramAt(plan, params, b, flat)
					if p < 0 {
						if got != 0 {
							t.Fatalf("%v: rank %d bucket %d: padding element %d = %g, want 0", r, rank, b, flat, got)
						}
						continue
					}
					if got != rr.full[step][p][i] && !(math.IsNaN(float64(got)) && math.IsNaN(float64(rr.full[step][p][i]))) {
						t.Fatalf("%v: rank %d: shard element %d of bucket %d = %g, the gathered gradient has %g", r, rank, j, b, got, rr.full[step][p][i])
					}
				}
			}
		}
	}
}

// paramAt maps element flat of bucket b to (param, index), or −1 for padding.
func paramAt(plan *Plan, params []Param, b, flat int) (int, int) {
	for _, p := range plan.Buckets[b].Params {
		off := plan.ParamOffset[p]
		if flat >= off && flat < off+params[p].Count {
			return p, flat - off
		}
	}
	return -1, 0
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
