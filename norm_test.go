package zero

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"testing"
	"time"
)

// TestNormChunkSums: a landing that sums squares stores the bits plain
// accumulate stores, raises the flag as it does, and its chunk sums are
// chunkSquares' over the result bit for bit, at any GOMAXPROCS; each chunk
// sum is within (chunk/16 + 4) ulp of the exact sum (16 lanes added in
// order, then a tree of 4 levels), checked against a compensated float64
// sum (neumaier).
func TestNormChunkSums(t *testing.T) {
	rng := testRNG(t)
	dev := CPU()
	s := NewHostStream()
	defer s.Close()
	dts := []DType{FP32, BF16, FP16}
	sizes := []int{0, 1, normChunk - 1, normChunk, normChunk + 1, 3*normChunk + 5, 40*normChunk + 77}
	procs := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(procs)
	for _, at := range dts {
		for _, st := range dts {
			for _, n := range sizes {
				for _, first := range []bool{true, false} {
					for _, scale := range []float32{1, 0.37} {
						if raceEnabled && n > parallelThreshold && (!first || scale != 1) {
							continue // the parallel split once per dtype pair: make test sweeps it all without the race detector
						}
						what := fmt.Sprintf("acc %v src %v n %d first %v scale %v", at, st, n, first, scale)
						off := 3 // the segment does not start at the accumulator's start
						acc, src := newTBuf(at, n+off), newTBuf(st, n)
						for i := range acc.len() {
							acc.set(i, float32(rng.NormFloat64()))
						}
						for i := range n {
							src.set(i, float32(rng.NormFloat64()*math.Exp2(float64(rng.IntN(9)-4))))
						}
						overflows := n > 5 && at == FP16 && !first && scale == 1
						if overflows {
							acc.set(off+n/2, 65504)
							src.set(n/2, 65504) // the sum rounds to inf in fp16: the flag must rise
						}
						plain, fused := acc.clone(), acc.clone()
						chunks := chunksOf(n)
						parts, again := make([]float32, 2*chunks+2), make([]float32, 2*chunks+2)
						flagPlain, flagFused := []float32{0}, []float32{0}
						seg := flatPiece{Src: src.t(), Offset: off}
						runtime.GOMAXPROCS(1 + rng.IntN(3))
						err := errors.Join(
							dev.accumulate(s, plain.t(), []flatPiece{seg}, first, scale, Float32s(flagPlain)),
							dev.accumulateSquares(s, fused.t(), seg, first, scale, Float32s(flagFused), Float32s(parts)),
							s.Sync())
						if err != nil {
							t.Fatalf("%s: %v", what, err)
						}
						for i := range acc.len() {
							if plain.bits(i) != fused.bits(i) {
								t.Fatalf("%s: element %d: %#x stored, accumulate stores %#x", what, i, fused.bits(i), plain.bits(i))
							}
						}
						if flagPlain[0] != flagFused[0] || overflows != (flagFused[0] != 0) {
							t.Fatalf("%s: flag %v, accumulate's %v", what, flagFused[0], flagPlain[0])
						}
						runtime.GOMAXPROCS(1 + rng.IntN(3))
						stored := fused.t().slice(off, n)
						if err := errors.Join(dev.chunkSquares(s, stored, Float32s(again)), s.Sync()); err != nil {
							t.Fatalf("%s: %v", what, err)
						}
						got, want := float64s(Float32s(parts)), float64s(Float32s(again))
						for k := range chunks {
							if math.Float64bits(got[k]) != math.Float64bits(want[k]) {
								t.Fatalf("%s: chunk %d: landing's sum %v, chunkSquares' %v", what, k, got[k], want[k])
							}
							if flagFused[0] != 0 {
								continue // an inf square: no bound to check
							}
							lo, hi := k*normChunk, min((k+1)*normChunk, n)
							vals := make([]float64, 0, hi-lo)
							for i := lo; i < hi; i++ {
								v := float64(fused.val(off + i))
								vals = append(vals, v*v) // exact: an fp32 value's square
							}
							exact := neumaier(vals)
							if bound := float64(normChunk/16+4) * 0x1p-53 * exact; math.Abs(got[k]-exact) > bound {
								t.Fatalf("%s: chunk %d: %v, exact %v: off by %.3g, bound %.3g", what, k, got[k], exact, got[k]-exact, bound)
							}
						}
					}
				}
			}
		}
	}
}

// TestNormChunkSumsRefuseBadInput: too few sums, a bad range, a bad dtype
// are typed errors, and nothing is written.
func TestNormChunkSumsRefuseBadInput(t *testing.T) {
	dev := CPU()
	s := NewHostStream()
	defer s.Close()
	x := newTBuf(FP32, 2*normChunk+1)
	short := make([]float32, 5) // three chunks need 6 words
	if err := dev.chunkSquares(s, x.t(), Float32s(short)); !errors.Is(err, ErrGradSize) {
		t.Errorf("chunkSquares into 5 words for 3 chunks: %v, want ErrGradSize", err)
	}
	if err := dev.accumulateSquares(s, x.t(), flatPiece{Src: x.t().slice(0, 10), Offset: x.len() - 5}, true, 1, Tensor{}, Float32s(short)); !errors.Is(err, ErrGradSize) {
		t.Errorf("accumulateSquares past the accumulator's end: %v, want ErrGradSize", err)
	}
	halfs := Halfs(make([]uint16, 6), BF16)
	if err := dev.accumulateSquares(s, x.t(), flatPiece{Src: x.t().slice(0, 10)}, true, 1, Tensor{}, halfs); !errors.Is(err, ErrGradSize) {
		t.Errorf("accumulateSquares into bf16 sums: %v, want ErrGradSize", err)
	}
	if err := dev.sumChunks(s, Float32s(short), []chunkRange{{2, 1}}, Float32s(make([]float32, 2))); !errors.Is(err, ErrGradSize) {
		t.Errorf("sumChunks of range [2, 1): %v, want ErrGradSize", err)
	}
	if err := dev.sumChunks(s, Float32s(short), []chunkRange{{0, 4}}, Float32s(make([]float32, 2))); !errors.Is(err, ErrGradSize) {
		t.Errorf("sumChunks of 4 sums out of 2: %v, want ErrGradSize", err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	for i, w := range short {
		if w != 0 {
			t.Fatalf("word %d written after a refusal", i)
		}
	}
}

// TestNormInLanding: with the step's last landings known (Grads.AccumSteps,
// SetBoundary, a window's or NoSync's flush, ZeRO-1's flush at Step), Step
// reads nothing of the shard for the norm, and the norm and the master
// weights have the bits of the same run with Step's own pass over the
// shard; with a landing after the boundary, Step reads the shard again.
// The clip is far below the norm, so the norm's bits reach the weights.
func TestNormInLanding(t *testing.T) {
	data := makeNormData(testSeed(t))
	for _, stage := range []int{1, 2, 3} {
		for _, offload := range []bool{false, true} {
			for _, sdt := range []DType{FP32, BF16} {
				for _, way := range normWays {
					what := fmt.Sprintf("stage %d offload %v shard %v %s", stage, offload, sdt, way.name)
					pass := runNormWay(t, data, stage, offload, sdt, way, false)
					fused := runNormWay(t, data, stage, offload, sdt, way, true)
					// Every bucket is landed by a backward of its own at
					// stages 2 and 3, the last of them unknown.
					wantRead := int64(0)
					if stage > 1 && (way.name == "unknown" || way.name == "boundary-early") {
						wantRead = fused.shard[0]
					}
					for rank := range 2 {
						for st := range fused.norm[rank] {
							if pass.read[rank][st] != pass.shard[rank] {
								t.Fatalf("%s: rank %d step %d: Step's own pass read %d bytes, the shard has %d", what, rank, st, pass.read[rank][st], pass.shard[rank])
							}
							if fused.read[rank][st] != wantRead {
								t.Fatalf("%s: rank %d step %d: NormReadBytes %d, want %d", what, rank, st, fused.read[rank][st], wantRead)
							}
							if fused.norm[rank][st] != pass.norm[rank][st] {
								t.Fatalf("%s: rank %d step %d: GradNorm %v, Step's pass gives %v", what, rank, st,
									math.Float64frombits(fused.norm[rank][st]), math.Float64frombits(pass.norm[rank][st]))
							}
							if !slices.Equal(fused.master[rank][st], pass.master[rank][st]) {
								t.Fatalf("%s: rank %d step %d: master weights differ from the run with Step's pass", what, rank, st)
							}
						}
					}
				}
			}
		}
	}
}

// TestNormOrderVsFloat64: the norm's summation order (each chunk in
// zero_sumsq's 16 lanes, a bucket's chunks in order, the buckets in order)
// is the documented one, bit for bit, and no worse than the order it
// replaced (the whole shard split in GOMAXPROCS parts, each in the lanes,
// the parts added): its error bound, (chunk/16 + 4 + chunks + buckets) ulp
// of the sum, is below that one's, (n/16/parts + 4 + parts) ulp, and both
// measured errors against a compensated float64 sum are logged.
func TestNormOrderVsFloat64(t *testing.T) {
	rng := testRNG(t)
	const n, bucket, parts = 5<<20 + 3, 3<<19 + 77, 2
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * math.Exp2(float64(rng.IntN(41)-20)))
	}
	dev := CPU()
	s := NewHostStream()
	defer s.Close()
	var ranges []chunkRange
	for lo, at := 0, 0; lo < n; lo += bucket {
		ranges = append(ranges, chunkRange{at, at + chunksOf(min(bucket, n-lo))})
		at = ranges[len(ranges)-1].hi
	}
	sums, outs := make([]float32, 2*ranges[len(ranges)-1].hi), make([]float32, 2*len(ranges))
	for b, r := range ranges {
		lo := b * bucket
		part := Float32s(x).slice(lo, min(bucket, n-lo))
		if err := dev.chunkSquares(s, part, Float32s(sums).slice(2*r.lo, 2*(r.hi-r.lo))); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(dev.sumChunks(s, Float32s(sums), ranges, Float32s(outs)), s.Sync()); err != nil {
		t.Fatal(err)
	}
	got, want := 0.0, 0.0
	for _, v := range float64s(Float32s(outs)) {
		got += v
	}
	for lo := 0; lo < n; lo += bucket {
		bsum := 0.0
		for c := lo; c < min(lo+bucket, n); c += normChunk {
			bsum += refSumSqLanes(x[c:min(c+normChunk, lo+bucket, n)])
		}
		want += bsum
	}
	if got != want {
		t.Fatalf("norm's sum %v, the documented order gives %v", got, want)
	}
	old := 0.0
	for k := range parts {
		old += refSumSqLanes(x[k*n/parts : (k+1)*n/parts])
	}
	vals := make([]float64, n)
	for i, v := range x {
		vals[i] = float64(v) * float64(v)
	}
	exact := neumaier(vals)
	u := 0x1p-53 * exact
	chunks := chunksOf(bucket)
	bound, oldBound := float64(normChunk/16+4+chunks+len(ranges))*u, float64(n/16/parts+4+parts)*u
	t.Logf("sum %.17g: error %.3g ulp (bound %.0f), the old order's %.3g ulp (bound %.0f)",
		exact, math.Abs(got-exact)/u, bound/u, math.Abs(old-exact)/u, oldBound/u)
	if math.Abs(got-exact) > bound || bound > oldBound {
		t.Fatalf("error %.3g, bound %.3g, the old order's bound %.3g", math.Abs(got-exact), bound, oldBound)
	}
}

// TestNormAddsBucketsInOrder: Step's norm adds the buckets' sums in bucket
// order, in float64 (the documented order), on the device and offloaded.
// Bucket 0 (the parameter registered last) sums to 2^53, where float64's
// ulp is 2, and 32 buckets after it to 1 each: in bucket order each 1
// rounds away (ties to even), so the sum is 2^53; in any other order some
// of the ones add up first and survive.
func TestNormAddsBucketsInOrder(t *testing.T) {
	const small = 32
	params := make([]Param, small+1)
	grads := make([]Tensor, small+1)
	for p := range small {
		params[p] = Param{Name: fmt.Sprint("one", p), Count: 1, DType: FP32, Data: Float32s(make([]float32, 1))}
		grads[p] = Float32s([]float32{1})
	}
	params[small] = Param{Name: "big", Count: 2, DType: FP32, Data: Float32s(make([]float32, 2))}
	grads[small] = Float32s([]float32{0x1p26, 0x1p26}) // 2 · 2^52
	inOrder, reversed := 0.0, 0.0
	bucketSums := []float64{0x1p53}
	for range small {
		bucketSums = append(bucketSums, 1)
	}
	for b := range bucketSums {
		inOrder += bucketSums[b]
		reversed += bucketSums[len(bucketSums)-1-b]
	}
	if math.Sqrt(inOrder) == math.Sqrt(reversed) {
		t.Fatal("the orders agree: the case cannot tell them apart")
	}
	for _, offload := range []bool{false, true} {
		cfg := Config{Stage: 2, BucketBytes: 4, Align: 1, Offload: OffloadPolicy{Optimizer: offload},
			Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0)}}}
		errs := onEngines(1, 10*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
			if n := len(e.Plan().Buckets); n != small+1 || !slices.Equal(e.Plan().Buckets[0].Params, []int{small}) {
				return fmt.Errorf("%d buckets, bucket 0 holds %v; want %d, the big parameter first", n, e.Plan().Buckets[0].Params, small+1)
			}
			if err := backward(e, s, grads); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
			if got, want := e.Stats().GradNorm, math.Sqrt(inOrder); got != want {
				return fmt.Errorf("norm %v, want %v (√ of the sums in bucket order); in reverse order it would be %v", got, want, math.Sqrt(reversed))
			}
			return nil
		})
		everyRankIs(t, fmt.Sprintf("offload %v", offload), errs, nil)
	}
}

func runNormWay(t *testing.T, d normData, stage int, offload bool, shardDType DType, way normWay, fused bool) normRun {
	t.Helper()
	return runNormWayIn(t, d, stage, offload, shardDType, FP32, way, fused)
}
