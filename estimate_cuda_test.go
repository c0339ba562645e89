//go:build cuda

package zero

import (
	"testing"
)

// The estimator on a GPU: the engine's allocations through the CUDA driver
// have the estimate's high-water marks, and NVML's used memory grows by the
// estimate, the difference bounded by the driver's page granularity.

// TestCUDAEstimateMatchesAllocations: on the one-GPU group, stages 1-3 ×
// offload × window (none, Coalesce, Coalesce under half the sums' budget)
// × shard dtype, two ranks, two backwards a step, and at stage 3 with the
// parameter shard offloaded too: the engine's device and page-locked host
// allocations reach the estimate to the byte.
func TestCUDAEstimateMatchesAllocations(t *testing.T) {
	d := needCUDA(t)
	seed := testSeed(t)
	params, sets := estimateModel(BF16)
	env := gpuTrainEnv(d)
	const bucket = 512
	for _, stage := range []int{1, 2, 3} {
		for _, offload := range []bool{false, true} {
			for _, onHost := range []bool{false, stage == 3} {
				const world = 2
				for _, window := range []string{"none", "coalesce", "budget"} {
					for _, shard := range []DType{FP32, BF16} {
						cfg := Config{Stage: stage, BucketBytes: bucket, Overlap: true}
						cfg.Offload.Optimizer, cfg.Offload.Params = offload, onHost
						cfg.Precision.ShardDType, cfg.Window.DType = shard, shard
						cfg.Optimizer.Groups = []Optimizer{NewAdamW(1e-3)}
						if window == "budget" {
							plan := newPlan(params, bucket, world, 64)
							for b := len(plan.Buckets) / 2; b < len(plan.Buckets); b++ {
								cfg.Window.BudgetBytes += shard.Size() * plan.Buckets[b].Padded
							}
						}
						c := estimateCase{cfg: cfg, world: world, run: Workload{Backwards: 2, Window: window != "none", Gathers: sets}}
						checkEstimateOn(t, env, func(int) *countingDevice { return newCountingDeviceOn(d) }, c, params, seed)
					}
				}
			}
		}
	}
}

// TestGPUEstimateNVML: one rank on the GPU trains a 68M-parameter bf16
// decoder with AdamW at stages 1-3, with and without a window; after the
// last Step, when the engine holds its high-water mark (the counting
// device says so), NVML's used memory has grown since New by the estimate,
// give or take one 2 MiB page per live allocation (the driver maps device
// memory in 2 MiB pages and may place small buffers in pages it already
// holds). The first run of each configuration warms the driver (modules,
// the sum of squares' scratch, stream resources); the second is measured.
func TestGPUEstimateNVML(t *testing.T) {
	d := needCUDA(t)
	if _, err := GPUMemoryInfo(); err != nil {
		skipOrFail(t, "no NVML on this GPU host: %v", err)
	}
	seed := testSeed(t)
	params, err := (TransformerShape{Hidden: 1024, Layers: 4, Vocab: 8192, FFN: 2816, Heads: 8}).Params(BF16)
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range params {
		params[i].Data = newTBuf(BF16, p.Count).t() // placed on the GPU by the run
	}
	used := func(ms []GPUMemory) (u int64) {
		for _, m := range ms {
			u += int64(m.Used)
		}
		return u
	}
	const page = 2 << 20
	for _, stage := range []int{1, 2, 3} {
		for _, window := range []bool{false, true} {
			cfg := Config{Stage: stage, BucketBytes: 32 << 20, Overlap: true, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-4)}}}
			c := estimateCase{cfg: cfg, world: 1, run: Workload{Backwards: 2, Window: window}}
			var est Estimation
			var ms []measured
			for range 2 {
				est, ms = checkEstimateOn(t, gpuTrainEnv(d), func(int) *countingDevice {
					dev := newCountingDeviceOn(d)
					dev.freeAtOnce = true // NVML sees only what is really freed
					return dev
				}, c, params, seed)
			}
			m := ms[0]
			if m.live != m.device {
				t.Fatalf("%v: %d bytes live after the last Step, high-water %d: NVML would not see the peak here; drive the test to its peak", c, m.live, m.device)
			}
			if m.before == nil || m.at == nil {
				t.Fatalf("%v: no NVML figures from the engine's device (before %v, after %v)", c, m.before, m.at)
			}
			grew, want := used(m.at)-used(m.before), est.Device.Engine()
			slack := int64(m.allocs) * page
			t.Logf("figure: estimate %v: NVML used grew %.1f MiB, estimate %.1f MiB, difference %+.1f MiB (allowed ± %.0f MiB: %d live allocations)",
				c, float64(grew)/(1<<20), float64(want)/(1<<20), float64(grew-want)/(1<<20), float64(slack)/(1<<20), m.allocs)
			if grew < want-slack || grew > want+slack {
				t.Errorf("%v: NVML used grew by %d bytes; the estimate is %d, ± %d for %d allocations' pages", c, grew, want, slack, m.allocs)
			}
		}
	}
}
