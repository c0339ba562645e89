package zero

import (
	"errors"
	"fmt"
	"math/rand"
	"reflect"
	"strings"
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
										c := estimateCase{cfg: cfg, world: world, run: Workload{Backwards: 2, Window: window, Gathers: sets}}
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
					checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Workload{Backwards: 1, Window: true, Gathers: sets}}, params, seed)
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
					checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Workload{Backwards: 3, Window: true, Gathers: sets}}, params, seed)
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
				checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Workload{Backwards: 2, Gathers: sets}}, built, seed)
			}
		}
	}
	for _, pp := range []ParamPolicy{{PrefetchBytes: -1}, {PrefetchBytes: 4096}, {PrefetchBytes: 4096, LiveParamBytes: 3 * 2048}} {
		for _, gathers := range [][][]int{sets, single} {
			for _, onHost := range []bool{false, true} {
				cfg := Config{Stage: 3, BucketBytes: 512, Params: pp, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}
				cfg.Offload.Params = onHost
				checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Workload{Backwards: 2, Gathers: gathers}}, params, seed)
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
		run    Workload
		want   error
	}{
		{"world 0", params, good, 0, Workload{}, ErrConfig},
		{"stage 4", params, with(good, func(c *Config) { c.Stage = 4 }), 2, Workload{}, ErrConfig},
		{"no bucket", params, with(good, func(c *Config) { c.BucketBytes = 0 }), 2, Workload{}, ErrConfig},
		{"window dtype", params, with(good, func(c *Config) { c.Window.DType = FP16 }), 2, Workload{}, ErrConfig},
		{"parameter offload at stage 2", params, with(good, func(c *Config) { c.Offload.Params = true }), 2, Workload{}, ErrConfig},
		{"AdamW literal", params, with(good, func(c *Config) { c.Optimizer.Groups = []Optimizer{AdamW{}} }), 2, Workload{}, ErrConfig},
		{"group out of range", []Param{{Count: 4, DType: BF16, Group: 1}}, with(good, func(c *Config) { c.Optimizer.Groups = []Optimizer{NewSGD(1)} }), 2, Workload{}, ErrParam},
		{"mixed dtypes", []Param{{Count: 4, DType: BF16}, {Count: 4, DType: FP32}}, good, 2, Workload{}, ErrDType},
		{"no parameters", nil, good, 2, Workload{}, ErrParam},
		{"backwards", params, good, 2, Workload{Backwards: -1}, ErrConfig},
		{"gather set", params, good, 2, Workload{Gathers: [][]int{{0, 99}}}, ErrParam},
	} {
		if _, err := Estimate(c.params, c.cfg, c.world, c.run); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.what, err, c.want)
		}
	}
	// parameters without memory are estimated as if they had it, even with
	// an optimizer, which New would refuse for want of it
	bare := []Param{{Count: 1000, DType: BF16}}
	if _, err := Estimate(bare, with(good, func(c *Config) { c.Optimizer.Groups = []Optimizer{NewAdamW(1)} }), 2, Workload{}); err != nil {
		t.Errorf("parameters without memory: %v", err)
	}
	if _, err := (TransformerShape{Hidden: 10, Layers: 1, Vocab: 5, FFN: 4, Heads: 3}).Params(BF16); !errors.Is(err, ErrParam) {
		t.Errorf("TransformerShape with 3 heads of hidden 10: %v, want ErrParam", err)
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
		checkEstimate(t, estimateCase{cfg: cfg, world: 2, run: Workload{Backwards: 2}}, params, seed)
	}
}

// TestTransformerParams: Llama-2's published sizes, 6.74B and 68.98B, and
// a 70B estimate that plans without allocating, in well under a second.
func TestTransformerParams(t *testing.T) {
	for _, c := range []struct {
		shape TransformerShape
		want  int
	}{
		{TransformerShape{Hidden: 4096, Layers: 32, Vocab: 32000, FFN: 11008, Heads: 32}, 6_738_415_616},
		{TransformerShape{Hidden: 8192, Layers: 80, Vocab: 32000, FFN: 28672, Heads: 64, KVHeads: 8}, 68_976_648_192},
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
		est, err := Estimate(params, cfg, 1024, Workload{})
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
				est, err := Estimate(params, cfg, 2, Workload{})
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
	run   Workload
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
