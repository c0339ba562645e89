package zero

import (
	"math"
	mrand "math/rand"
	"testing"
)

// TestShardDType: a gradient shard kept in the model dtype gives the
// float64 mean within its rounding (one rounding per landing: per backward
// without a window, once with one), at every stage, with and without a
// window and offload; it holds half the bytes of an fp32 shard, in use,
// nothing else added (with offload, less the fp32 bucket the host widens
// the optimizer's gradient into). The error against float64 is logged beside the fp32
// shard's.
func TestShardDType(t *testing.T) {
	seed := testSeed(t)
	for _, dt := range []DType{BF16, FP16} {
		params := testParams(dt)
		base := runSpec{stage: 2, world: 2, dtype: dt, overlap: true, bucket: 512, backwards: 3, steps: 2, streams: 2, predivide: 1}
		data := makeWorkload(mrand.New(mrand.NewSource(seed)), base, params)
		for _, stage := range []int{1, 2, 3} {
			for _, window := range []string{"", "coalesce"} {
				for _, offload := range []bool{false, true} {
					r := base
					r.stage, r.window, r.windowEvery, r.offload = stage, window, true, offload
					wide := runEngine(t, r, params, data, seed)
					r.shard = dt
					narrow := runEngine(t, r, params, data, seed)
					checkMean(t, r, params, data, narrow)
					plan := narrow[0].plan
					for rank := range narrow {
						w, n := wide[rank].stats[1], narrow[rank].stats[1]
						saved, want := w.GradBytesInUse-n.GradBytesInUse, int64(plan.ShardElems*2)
						if offload { // the shard is on the host
							saved = w.HostGradBytes - n.HostGradBytes
							// where the optimizer widens a bucket's shard
							if all, scratch := w.HostBytes-n.HostBytes, int64(maxShardElems(plan)*4); all != want-scratch {
								t.Errorf("%v shard %v window %q rank %d: the host holds %d bytes less, want %d less the scratch %d", r, dt, window, rank, all, want, scratch)
							}
						}
						if saved != want {
							t.Errorf("%v shard %v window %q offload %v rank %d: the shard saves %d bytes, want %d (half the fp32 shard)", r, dt, window, offload, rank, saved, want)
						}
					}
					t.Logf("%v window %q offload %v: max error against float64, relative to mean |g|: %.2e with an fp32 shard, %.2e with %v",
						r, window, offload, relErr(r, params, data, wide), relErr(r, params, data, narrow), dt)
				}
			}
		}
	}
}

// relErr is the largest error of the ranks' full gradients against the
// float64 mean, relative to the mean of |g| (elements with |g| = 0 left out).
func relErr(r runSpec, params []Param, data workload, res []rankResult) float64 {
	worst := 0.0
	for step := range r.steps {
		for p := range params {
			for i := range params[p].Count {
				sum, mag := 0.0, 0.0
				for k := range r.backwards {
					for rank := range r.world {
						v := data[step][k][rank][p].ref[i]
						sum += v
						mag += math.Abs(v)
					}
				}
				if mag == 0 {
					continue
				}
				for _, rr := range res {
					worst = math.Max(worst, math.Abs(float64(rr.full[step][p][i])-sum/float64(r.world*r.backwards))/(mag/float64(r.world*r.backwards)))
				}
			}
		}
	}
	return worst
}
