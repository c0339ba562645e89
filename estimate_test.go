package zero

import (
	"errors"
	"fmt"
	"math/rand"
	"testing"
	"time"
)

// The estimator against the bytes the engine really allocates: a counting
// device's high-water mark of live device bytes and of page-locked host
// bytes, and the collectives Stats counts, for every stage, offload,
// window, shard dtype and window dtype at W = 1, 2, 4.

// estimateModel is a small bf16 model: tiny buckets split it into many,
// some parameters larger than a bucket, one empty and one frozen; gathered
// (at stage 3) in sets of two, as a framework gathers a layer.
func estimateModel() ([]Param, [][]int) {
	sizes := []int{300, 7, 1000, 0, 129, 64, 513, 1, 50}
	params := make([]Param, len(sizes))
	for i, n := range sizes {
		params[i] = Param{Name: fmt.Sprintf("p%d", i), Count: n, DType: BF16, Data: newTBuf(BF16, n).t()}
	}
	params[8].Frozen = true
	return params, [][]int{{0, 1}, {2, 3}, {4, 5}, {6, 7}}
}

// estimateCase is one configuration and how it is driven.
type estimateCase struct {
	cfg   Config
	world int
	run   Run
}

func (c estimateCase) String() string {
	p := c.cfg.Precision
	return fmt.Sprintf("stage %d W=%d offload %v window %v budget %d window %v shard %v comm %v backwards %d opt %T",
		c.cfg.Stage, c.world, c.cfg.Offload.Optimizer, c.run.Window, c.cfg.Window.BudgetBytes, c.cfg.Window.DType, p.ShardDType, p.CommDType, c.run.Backwards, c.cfg.Optimizer.Groups)
}

// measured is what one rank's engine really held and moved.
type measured struct {
	device, host int
	wire         CommCounters // the last step's
	stats        Stats
}

// runMeasured drives c on every rank of an in-process group, each rank's
// engine on its own counting device: steps of c.run.Backwards backwards
// (in a Coalesce window where c.run.Window), at stage 3 each set of
// c.run.Gathers gathered for the forward and again for the backward.
func runMeasured(t *testing.T, c estimateCase, params []Param, seed int64) []measured {
	t.Helper()
	comms, err := NewLocalGroupTimeout(c.world, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]measured, c.world)
	errs := eachRank(c.world, func(rank int) error {
		defer comms[rank].Close()
		dev := newCountingDevice()
		defer dev.release()
		e, err := New(c.cfg, onDevice{comms[rank], dev}, params)
		if err != nil {
			return err
		}
		s := NewHostStream()
		defer s.Close()
		rng := rand.New(rand.NewSource(seed + int64(rank)))
		grads := make([]Tensor, len(params))
		for p, q := range params {
			g := newTBuf(BF16, q.Count)
			for i := range g.len() {
				g.set(i, float32(rng.NormFloat64()))
			}
			grads[p] = g.t()
		}
		stage3 := c.cfg.Stage == 3
		sets := c.run.Gathers
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
		st := e.Stats()
		if err := e.Close(); err != nil {
			return err
		}
		out[rank].device, out[rank].host = dev.peaks()
		out[rank].wire, out[rank].stats = st.Collectives, st
		return nil
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("%v: rank %d: %v", c, rank, err)
		}
	}
	return out
}

// checkEstimate compares c's estimate with what runMeasured saw on every
// rank: device and host bytes to the byte, the collectives to the byte
// but for stage 3's gathers, where a prefetch that keeps a bucket from the
// forward to the backward saves a gather the estimate counts.
func checkEstimate(t *testing.T, c estimateCase, params []Param, seed int64) {
	t.Helper()
	est, err := Estimate(params, c.cfg, c.world, c.run)
	if err != nil {
		t.Fatalf("%v: %v", c, err)
	}
	for rank, m := range runMeasured(t, c, params, seed) {
		what := fmt.Sprintf("%v rank %d", c, rank)
		if got, want := int64(m.device), est.Device.Engine(); got != want {
			t.Errorf("%s: device high-water %d bytes, estimate %d (%+v)", what, got, want, est.Device)
		}
		if got, want := int64(m.host), est.Host.Total(); got != want {
			t.Errorf("%s: host high-water %d bytes, estimate %d (%+v)", what, got, want, est.Host)
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
						floor.add(KindAllGather, est.Plan.Buckets[b].Padded*2, c.world)
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
}

// TestEstimateMatchesAllocations: every stage × offload × window (none,
// coalesce, coalesce under a budget of half the sums) × shard dtype ×
// window dtype at W = 1, 2, 4, AdamW, two backwards a step: the estimate
// equals the counting device's high-water marks to the byte.
func TestEstimateMatchesAllocations(t *testing.T) {
	seed := testSeed(t)
	params, sets := estimateModel()
	const bucket = 512
	for _, stage := range []int{1, 2, 3} {
		for _, offload := range []bool{false, true} {
			for _, window := range []string{"none", "coalesce", "budget"} {
				for _, shard := range []DType{FP32, BF16} {
					for _, wdt := range []DType{FP32, BF16} {
						if window == "none" && wdt == BF16 {
							continue // no window, no window dtype
						}
						for _, world := range []int{1, 2, 4} {
							cfg := Config{Stage: stage, BucketBytes: bucket, Overlap: true}
							cfg.Offload.Optimizer = offload
							cfg.Precision.ShardDType = shard
							cfg.Window.DType = wdt
							cfg.Optimizer.Groups = []Optimizer{NewAdamW(1e-3)}
							if window == "budget" {
								plan := newPlan(params, bucket, world, 64)
								for b := len(plan.Buckets) / 2; b < len(plan.Buckets); b++ {
									cfg.Window.BudgetBytes += wdt.Size() * plan.Buckets[b].Padded
								}
							}
							c := estimateCase{cfg: cfg, world: world, run: Run{Backwards: 2, Window: window != "none", Gathers: sets}}
							checkEstimate(t, c, params, seed)
						}
					}
				}
			}
		}
	}
}

// TestEstimateOptimizersAndDTypes: the optimizer's state by kind (AdamW,
// amsgrad, SGD with and without momentum, none), an fp32 wire, one
// backward a step (no window scratch), stage-3 gathers of one parameter at
// a time and without prefetch, and a stage-3 prefetch capped by
// LiveParamBytes.
func TestEstimateOptimizersAndDTypes(t *testing.T) {
	seed := testSeed(t)
	params, sets := estimateModel()
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
				cfg := Config{Stage: stage, BucketBytes: 512, Overlap: true}
				cfg.Precision.CommDType = comm
				cfg.Precision.ShardDType = BF16
				cfg.Window.DType = BF16
				cfg.Optimizer.Groups = groups
				checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Run{Backwards: 1, Window: true, Gathers: sets}}, params, seed)
			}
		}
	}
	for _, pp := range []ParamPolicy{{PrefetchBytes: -1}, {PrefetchBytes: 4096}, {PrefetchBytes: 4096, LiveParamBytes: 3 * 2048}} {
		for _, gathers := range [][][]int{sets, single} {
			cfg := Config{Stage: 3, BucketBytes: 512, Params: pp, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}
			checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Run{Backwards: 2, Gathers: gathers}}, params, seed)
		}
	}
}

// TestEstimateRefuses: what New refuses, Estimate refuses with the same
// error; a world size below 1, a negative Run.Backwards and a gather set
// naming no parameter are ErrConfig and ErrParam.
func TestEstimateRefuses(t *testing.T) {
	params, _ := estimateModel()
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
