package zero

import (
	"errors"
	"testing"
	"time"
)

// The estimator against the bytes the engine really allocates: a counting
// device's high-water mark of live device bytes and of page-locked host
// bytes, and the collectives Stats counts, for every stage, offload,
// window, shard dtype and window dtype at W = 1, 2, 4.

// checkEstimate is checkEstimateOn on the host, in-process ranks.
func checkEstimate(t *testing.T, c estimateCase, params []Param, seed int64) (Estimation, []measured) {
	t.Helper()
	return checkEstimateOn(t, hostTrain, func(int) *countingDevice { return newCountingDevice() }, c, params, seed)
}

// TestEstimateMatchesAllocations: every stage × offload × window (none, a
// Coalesce window) × window budget (none, half the window's sums) ×
// stage-3 gather budgets (paramBudgets) and parameter offload (off, on) ×
// shard dtype × window dtype at W = 1, 2, 4, AdamW, two backwards a step:
// the estimate equals the counting device's high-water marks to the byte.
func TestEstimateMatchesAllocations(t *testing.T) {
	seed := testSeed(t)
	params, sets := estimateModel(BF16)
	const bucket = 512
	runs := 0
	for _, stage := range []int{1, 2, 3} {
		pps, onHost := paramBudgets[:1], []bool{false}
		if stage == 3 {
			pps, onHost = paramBudgets, []bool{false, true}
		}
		for _, offload := range []bool{false, true} {
			for _, paramsOnHost := range onHost {
				for _, window := range []bool{false, true} {
					for _, budget := range []bool{false, true} {
						for _, pp := range pps {
							for _, shard := range []DType{FP32, BF16} {
								for _, wdt := range []DType{FP32, BF16} {
									if !window && wdt == BF16 {
										continue // no window, no window dtype
									}
									for _, world := range []int{1, 2, 4} {
										cfg := Config{Stage: stage, BucketBytes: bucket, Overlap: true, Params: pp}
										cfg.Offload.Optimizer, cfg.Offload.Params = offload, paramsOnHost
										cfg.Precision.ShardDType = shard
										cfg.Window.DType = wdt
										cfg.Optimizer.Groups = []Optimizer{NewAdamW(1e-3)}
										if budget {
											plan := newPlan(params, bucket, world, 64)
											for b := len(plan.Buckets) / 2; b < len(plan.Buckets); b++ {
												cfg.Window.BudgetBytes += wdt.Size() * plan.Buckets[b].Padded
											}
										}
										c := estimateCase{cfg: cfg, world: world, run: Run{Backwards: 2, Window: window, Gathers: sets}}
										checkEstimate(t, c, params, seed)
										runs++
									}
								}
							}
						}
					}
				}
			}
		}
	}
	t.Logf("%d configurations, every rank's high-water marks equal to the estimate", runs)
}

// TestEstimateOptimizersAndDTypes: the optimizer's state by kind (AdamW,
// amsgrad, SGD with and without momentum, none), on the device and
// offloaded, an fp32 wire, one backward a step, fp16 (loss-scaled) and
// fp32 models, one and three staging buffers, a stage-3 model built
// sharded (Init) with and without the broadcast, stage-3 gathers of one
// parameter at a time and without prefetch, and a stage-3 prefetch capped
// by LiveParamBytes; at stage 3 each with the parameter shard offloaded
// too (on a bf16 wire, with three staging buffers, and beside each of the
// others).
func TestEstimateOptimizersAndDTypes(t *testing.T) {
	seed := testSeed(t)
	params, sets := estimateModel(BF16)
	amsgrad := NewAdamW(1e-3)
	amsgrad.AMSGrad = true
	momentum := NewSGD(0.1)
	momentum.Momentum = 0.9
	single := make([][]int, 0, len(params))
	for p := range params[:8] {
		single = append(single, []int{p})
	}
	for _, stage := range []int{1, 2, 3} {
		for _, groups := range [][]Optimizer{nil, {NewAdamW(1e-3)}, {amsgrad}, {NewSGD(0.1)}, {momentum}} {
			for _, comm := range []DType{BF16, FP32} {
				for _, offload := range []bool{false, true} {
					cfg := Config{Stage: stage, BucketBytes: 512, Overlap: true}
					cfg.Precision.CommDType = comm
					cfg.Precision.ShardDType = BF16
					cfg.Window.DType = BF16
					cfg.Optimizer.Groups = groups
					cfg.Offload.Optimizer = offload
					cfg.Offload.Params = stage == 3 && comm == BF16
					checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Run{Backwards: 1, Window: true, Gathers: sets}}, params, seed)
				}
			}
		}
	}
	for _, dt := range []DType{FP16, FP32} {
		params, sets := estimateModel(dt)
		for _, stage := range []int{1, 2, 3} {
			for _, offload := range []bool{false, true} {
				for _, staging := range []int{1, 3} {
					cfg := Config{Stage: stage, BucketBytes: 512, StagingBuffers: staging, Overlap: true}
					cfg.Offload.Optimizer = offload
					cfg.Offload.Params = stage == 3 && staging == 3
					cfg.Precision.ShardDType, cfg.Window.DType = dt, dt
					cfg.Optimizer.Groups = []Optimizer{NewAdamW(1e-3)}
					checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Run{Backwards: 3, Window: true, Gathers: sets}}, params, seed)
				}
			}
		}
	}
	// a stage-3 model built sharded (Param.Init), with and without rank 0's
	// broadcast: the upload's temporaries stay under the peak
	for _, groups := range [][]Optimizer{nil, {NewAdamW(1e-3)}} {
		for _, noBroadcast := range []bool{false, true} {
			for _, onHost := range []bool{false, true} {
				built, sets := estimateModel(BF16)
				for i := range built {
					if !built[i].Frozen {
						built[i].Data, built[i].Init = Tensor{}, func(dst []float32, off int) error {
							for j := range dst {
								dst[j] = float32(off+j) * 1e-3
							}
							return nil
						}
					}
				}
				cfg := Config{Stage: 3, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: groups}}
				cfg.Params.NoBroadcast = noBroadcast
				cfg.Offload.Params = onHost
				checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Run{Backwards: 2, Gathers: sets}}, built, seed)
			}
		}
	}
	for _, pp := range []ParamPolicy{{PrefetchBytes: -1}, {PrefetchBytes: 4096}, {PrefetchBytes: 4096, LiveParamBytes: 3 * 2048}} {
		for _, gathers := range [][][]int{sets, single} {
			for _, onHost := range []bool{false, true} {
				cfg := Config{Stage: 3, BucketBytes: 512, Params: pp, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}
				cfg.Offload.Params = onHost
				checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Run{Backwards: 2, Gathers: gathers}}, params, seed)
			}
		}
	}
}

// TestEstimateRefuses: what New refuses, Estimate refuses with the same
// error; a world size below 1, a negative Run.Backwards and a gather set
// naming no parameter are ErrConfig and ErrParam.
func TestEstimateRefuses(t *testing.T) {
	params, _ := estimateModel(BF16)
	good := Config{Stage: 2, BucketBytes: 512}
	for _, c := range []struct {
		what   string
		params []Param
		cfg    Config
		world  int
		run    Run
		want   error
	}{
		{"world 0", params, good, 0, Run{}, ErrConfig},
		{"stage 4", params, with(good, func(c *Config) { c.Stage = 4 }), 2, Run{}, ErrConfig},
		{"no bucket", params, with(good, func(c *Config) { c.BucketBytes = 0 }), 2, Run{}, ErrConfig},
		{"window dtype", params, with(good, func(c *Config) { c.Window.DType = FP16 }), 2, Run{}, ErrConfig},
		{"parameter offload at stage 2", params, with(good, func(c *Config) { c.Offload.Params = true }), 2, Run{}, ErrConfig},
		{"AdamW literal", params, with(good, func(c *Config) { c.Optimizer.Groups = []Optimizer{AdamW{}} }), 2, Run{}, ErrConfig},
		{"group out of range", []Param{{Count: 4, DType: BF16, Group: 1}}, with(good, func(c *Config) { c.Optimizer.Groups = []Optimizer{NewSGD(1)} }), 2, Run{}, ErrParam},
		{"mixed dtypes", []Param{{Count: 4, DType: BF16}, {Count: 4, DType: FP32}}, good, 2, Run{}, ErrDType},
		{"no parameters", nil, good, 2, Run{}, ErrParam},
		{"backwards", params, good, 2, Run{Backwards: -1}, ErrConfig},
		{"gather set", params, good, 2, Run{Gathers: [][]int{{0, 99}}}, ErrParam},
	} {
		if _, err := Estimate(c.params, c.cfg, c.world, c.run); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.what, err, c.want)
		}
	}
	// parameters without memory are estimated as if they had it, even with
	// an optimizer, which New would refuse for want of it
	bare := []Param{{Count: 1000, DType: BF16}}
	if _, err := Estimate(bare, with(good, func(c *Config) { c.Optimizer.Groups = []Optimizer{NewAdamW(1)} }), 2, Run{}); err != nil {
		t.Errorf("parameters without memory: %v", err)
	}
	if _, err := (Transformer{Hidden: 10, Layers: 1, Vocab: 5, FFN: 4, Heads: 3}).Params(BF16); !errors.Is(err, ErrParam) {
		t.Errorf("Transformer with 3 heads of hidden 10: %v, want ErrParam", err)
	}
	for _, c := range []struct{ total, largest int }{{0, 1}, {10, 0}, {10, 11}} {
		if _, err := CountParams(c.total, c.largest, BF16); !errors.Is(err, ErrParam) {
			t.Errorf("CountParams(%d, %d): %v, want ErrParam", c.total, c.largest, err)
		}
	}
	if _, err := CountParams(10, 5, 0); !errors.Is(err, ErrDType) {
		t.Errorf("CountParams with no dtype: %v, want ErrDType", err)
	}
}

// TestCountParams: a count and a largest layer make parameters of that
// size and a remainder, summing to the count; the estimate of such a list
// matches the allocations like any other.
func TestCountParams(t *testing.T) {
	for _, c := range []struct{ total, largest, n, last int }{{10, 5, 2, 5}, {11, 5, 3, 1}, {7, 7, 1, 7}, {1, 1, 1, 1}} {
		params, err := CountParams(c.total, c.largest, BF16)
		if err != nil {
			t.Fatal(err)
		}
		sum := 0
		for _, p := range params {
			sum += p.Count
			if p.Count > c.largest || p.DType != BF16 {
				t.Errorf("CountParams(%d, %d): %+v", c.total, c.largest, p)
			}
		}
		if len(params) != c.n || sum != c.total || params[len(params)-1].Count != c.last {
			t.Errorf("CountParams(%d, %d): %d parameters summing to %d, the last %d; want %d, %d, %d", c.total, c.largest, len(params), sum, params[len(params)-1].Count, c.n, c.total, c.last)
		}
	}
	params, err := CountParams(3000, 700, BF16)
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range params {
		params[i].Data = newTBuf(BF16, p.Count).t()
	}
	seed := testSeed(t)
	for _, stage := range []int{1, 2, 3} {
		cfg := Config{Stage: stage, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}
		checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Run{Backwards: 2}}, params, seed)
	}
}

// TestTransformerParams: Llama-2's published sizes, 6.74B and 68.98B, and
// a 70B estimate that plans without allocating, in well under a second.
func TestTransformerParams(t *testing.T) {
	for _, c := range []struct {
		shape Transformer
		want  int
	}{
		{Transformer{Hidden: 4096, Layers: 32, Vocab: 32000, FFN: 11008, Heads: 32}, 6_738_415_616},
		{Transformer{Hidden: 8192, Layers: 80, Vocab: 32000, FFN: 28672, Heads: 64, KVHeads: 8}, 68_976_648_192},
	} {
		params, err := c.shape.Params(BF16)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, p := range params {
			n += p.Count
		}
		if n != c.want {
			t.Errorf("%+v: %d parameters, want %d", c.shape, n, c.want)
		}
		start := time.Now()
		cfg := Config{Stage: 3, BucketBytes: 32 << 20, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-4)}}}
		est, err := Estimate(params, cfg, 1024, Run{})
		if err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("%+v: the estimate took %v", c.shape, d)
		}
		if int64(est.Plan.ShardElems)*1024 < int64(n) {
			t.Errorf("%+v: shards of %d elements cannot hold %d parameters", c.shape, est.Plan.ShardElems, n)
		}
	}
}

// TestEstimateFrameworkParams: the framework's own parameter memory is
// every parameter at stages 1 and 2 (Step writes the new values into it)
// and, at stage 3, the frozen ones only (the engine reads their memory for
// good; the others may be freed after New), in the model dtype; Total and
// ModelStates count it, Engine does not.
func TestEstimateFrameworkParams(t *testing.T) {
	for _, dt := range []DType{BF16, FP32} {
		params, _ := estimateModel(dt)
		all, frozen := int64(0), int64(0)
		for _, p := range params {
			all += int64(p.Count * dt.Size())
			if p.Frozen {
				frozen += int64(p.Count * dt.Size())
			}
		}
		if frozen == 0 || frozen == all {
			t.Fatal("the model needs frozen and trained parameters")
		}
		for _, stage := range []int{1, 2, 3} {
			for _, offload := range []bool{false, true} {
				cfg := Config{Stage: stage, BucketBytes: 512, Offload: OffloadPolicy{Optimizer: offload},
					Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}
				est, err := Estimate(params, cfg, 2, Run{})
				if err != nil {
					t.Fatal(err)
				}
				want := all
				if stage == 3 {
					want = frozen
				}
				d := est.Device
				if d.FrameworkParams != want || d.Total()-d.Engine() != want || d.ModelStates()-(d.ParamShard+d.GradShard+d.LocalSums+d.WindowSums+d.Master+d.OptimizerState+d.NewParams) != want {
					t.Errorf("%v stage %d offload %v: FrameworkParams %d (Total − Engine %d), want %d", dt, stage, offload, d.FrameworkParams, d.Total()-d.Engine(), want)
				}
			}
		}
	}
}
