package zero

import (
	"fmt"
	"math"
	"math/rand"
	"slices"
	"testing"
	"time"
)

// TestDifferentialMatrix runs every combination of stage, world, dtype,
// overlap, bucket size, backwards per step and predivide factor against the
// float64 mean. Under the race detector a third of them, drawn from the
// seed (make test runs them all without it).
func TestDifferentialMatrix(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	pick := rand.New(rand.NewSource(seed + 1))
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
								if raceEnabled && pick.Intn(3) != 0 {
									continue
								}
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
