//go:build cuda

package zero

import (
	mrand "math/rand"
	"math/rand/v2"
	"testing"
)

// TestCUDAOffloadMatchesCPU: on the one-GPU group with offload (the reduced
// shards copied from device memory to page-locked host memory on the copy
// stream and summed by the host), the gradients have the bits of the CPU
// path without offload, stages 1-3, W 2 and 4, every dtype, three backwards
// per step, in and out of coalesced windows; AdamW training with the
// optimizer on the host has the bits of CPU training without offload, every
// step, at stages 1 and 2 (stage 3: TestCUDAStage3Gather).
func TestCUDAOffloadMatchesCPU(t *testing.T) {
	d := needCUDA(t)
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(uint64(seed), 5))
	n := 0
	for _, stage := range []int{1, 2, 3} {
		for _, world := range []int{2, 4} {
			for _, dt := range allDTypes {
				params := testParams(dt)
				r := runSpec{stage: stage, world: world, dtype: dt, backwards: 3, steps: 2, streams: 2, overlap: rng.IntN(2) == 0,
					bucket: 1024, predivide: 1, window: []string{"", "coalesce", "nosync"}[rng.IntN(3)]}
				data := makeWorkload(mrand.New(mrand.NewSource(rng.Int64())), r, params)
				cpu := runEngine(t, r, params, data, seed)
				r.offload = true
				gpu := runEngineCUDA(t, d, r, params, data, seed)
				if err := sameShards(cpu, gpu); err != nil {
					t.Fatalf("%v window %q with offload: %v", r, r.window, err)
				}
				for rank := range gpu {
					if s := gpu[rank].stats[0]; s.HostPinnedBytes != s.HostBytes || s.HostGradBytes == 0 {
						t.Fatalf("%v: host bytes %d, pinned %d, gradients %d: cuMemHostAlloc memory is all page-locked", r, s.HostBytes, s.HostPinnedBytes, s.HostGradBytes)
					}
				}
				n++
			}
		}
	}
	env := gpuTrainEnv(d)
	opt := with(NewAdamW(0.01), func(o *AdamW) { o.WeightDecay = 0.01 })
	q := newQuadTask(mrand.New(mrand.NewSource(rng.Int64())), []int{37, 130, 8, 257, 3000}, 8, 2*3)
	for _, dt := range []DType{FP32, BF16} {
		for _, stage := range []int{1, 2} {
			r := trainRun{stage: stage, world: 2, backwards: 3, dtype: dt, bucket: 512, overlap: true}
			offloaded := r
			offloaded.offload = true
			trainsAsCPU(t, env, q, opt, r, offloaded)
			n++
		}
	}
	t.Logf("%d configurations with offload bit-identical to the CPU path without it", n)
}
