package zero

import (
	"fmt"
	"slices"
)

// The estimator: what one rank of an engine will hold and move, from the
// parameters, the Config and the world size, before any memory exists. It
// builds the engine's own plan (newPlan) and the window's own choice of
// deferred buckets, and applies the allocation rules of the components to
// them; estimate_test.go holds it to the bytes a counting device really
// sees. Nothing is allocated: a 70B model estimates in half a millisecond.

// Workload is how the engine will be driven, where memory or traffic
// depend on it: the estimator's input beside the parameters and the Config.
type Workload struct {
	// Backwards is the number of backwards per Step (0: 1).
	Backwards int
	// Window: every step's backwards run in a Coalesce window (or NoSync),
	// so the window's sums exist (within Window.BudgetBytes).
	Window bool
	// Gathers, at stage 3, are the sets of parameters the framework holds
	// gathered at once, e.g. one layer's (nil: one parameter at a time, as
	// DeepSpeed gathers a module's own parameters).
	Gathers [][]int
}

// Run is the old name of Workload.
//
// Deprecated: use Workload; Run goes at the next release.
type Run = Workload

// Estimation is one rank's memory at its peak and one step's collectives.
// Its memory categories add up to the fields Stats reports (Stats gives
// them in those words).
type Estimation struct {
	Plan   *Plan       // the plan the engine would build
	Device DeviceBytes // device memory by kind
	Host   HostBytes   // page-locked host memory (Offload.Optimizer, Offload.Params)
	// Wire is one step's collectives as Stats.Collectives counts them
	// (ring model). At stage 3 each set of Workload.Gathers gathers its buckets
	// for the forward and again for the backward of each backward: exact
	// without prefetch; with it an upper bound, since a bucket the prefetch
	// keeps gathered from one ask to the next is not gathered again.
	Wire CommCounters
	// window: the run's backwards were in a window (WindowResidentBytes)
	window bool
}

// Stats is the estimate in the words of the Stats a Step of the run
// reports on this rank: the memory fields PeakGradBytes,
// ResidentGradBytes, PooledGradBytes, GradBytesInUse, WindowResidentBytes
// (with Workload.Window), OptimizerBytes, ControlBytes, ParamShardBytes,
// PeakParamBytes, HostBytes, HostGradBytes, HostParamBytes and
// DeviceBytesSaved, each
// equal to the engine's once its pools hold what the run needs (from its
// first Step on, where no pool grew past the estimate); the other fields
// are zero. HostPinnedBytes is not estimated: on the CPU device it is what
// mlock accepts (all of HostBytes on a GPU).
func (e Estimation) Stats() Stats {
	d, h := e.Device, e.Host
	grads := d.GradShard + d.Staging + d.LocalSums + d.WindowSums
	st := Stats{
		PeakGradBytes: grads, ResidentGradBytes: grads,
		// at Step every staging buffer and sum is back in its pool
		PooledGradBytes: grads - d.GradShard, GradBytesInUse: d.GradShard,
		OptimizerBytes:  d.GradScratch + d.Master + d.OptimizerState + d.NewParams + d.ParamGather,
		ControlBytes:    d.Control,
		ParamShardBytes: d.ParamShard, PeakParamBytes: d.ParamShard + d.Gathered,
		HostBytes: h.Total(), HostGradBytes: h.GradShard + h.Landing, HostParamBytes: h.ParamShard,
		DeviceBytesSaved: h.GradShard + h.Master + h.OptimizerState + h.ParamShard,
	}
	if e.window {
		st.WindowResidentBytes = grads
	}
	return st
}

// Estimate is what one rank of an engine built by New(cfg, comm, params)
// with comm.Size() == world holds at its peak, and what one step moves,
// when driven as run says. It refuses what New refuses, with the same
// errors (ErrConfig, ErrParam, ErrDType); parameters need no memory (Data,
// Init): with an optimizer the estimate assumes they have it, as New
// requires. The engine's pools can grow past it where buckets complete out
// of order (more staging buffers, Stats.StagingBuffers shows it).
func Estimate(params []Param, cfg Config, world int, run Workload) (Estimation, error) {
	if world < 1 {
		return Estimation{}, errorf(ErrConfig, "Estimate: world size %d; a group needs at least one rank", world)
	}
	if run.Backwards < 0 {
		return Estimation{}, errorf(ErrConfig, "Estimate: Workload.Backwards %d; give 1 or more, or 0 for 1", run.Backwards)
	}
	model, err := resolveForEstimate(&cfg, params)
	if err != nil {
		return Estimation{}, err
	}
	for i, set := range run.Gathers {
		for _, p := range set {
			if p < 0 || p >= len(params) {
				return Estimation{}, errorf(ErrParam, "Estimate: Workload.Gathers[%d] names parameter %d; registered parameters are 0..%d", i, p, len(params)-1)
			}
		}
	}
	plan := newPlan(params, cfg.BucketBytes, world, cfg.Align)
	est := Estimation{Plan: plan, window: run.Window}
	msize, comm, sdt := int64(model.Size()), int64(cfg.Precision.CommDType.Size()), cfg.Precision.ShardDType
	optimizer := len(cfg.Optimizer.Groups) > 0
	stage3 := cfg.Stage == 3 && (optimizer || hasParamMemory(params))
	offload := cfg.Offload.Optimizer
	paramsOnHost := stage3 && cfg.Offload.Params

	// Each component says what it allocates, from the same settings New
	// hands it; the estimate adds them up.
	d, h := &est.Device, &est.Host
	for _, p := range params {
		if !stage3 || p.Frozen {
			d.FrameworkParams += int64(p.Count) * msize
		}
	}
	if offload {
		*h = h.plus(offloadSize(plan, cfg.Precision.CommDType, sdt, cfg.StagingBuffers, optimizer))
	} else {
		*d = d.plus(deviceSinkSize(plan, sdt, optimizer))
	}
	modes := stageBucketModes(cfg.Stage, len(plan.Buckets))
	spec := pipelineSpec{modes: modes, staging: cfg.StagingBuffers, windowDType: cfg.Window.DType, commDType: cfg.Precision.CommDType,
		prescale: float32(1 / cfg.Grads.PredivideFactor)}
	inForce := modes // the modes of the step's backwards
	var inWindow []bool
	if run.Window {
		inWindow = windowLocal(plan, int64(cfg.Window.BudgetBytes), func(b int) (int, DType) { return localSum(plan, spec, b) })
		inForce = slices.Clone(modes)
		for b, in := range inWindow {
			if in {
				inForce[b] = deferred
			}
		}
	}
	*d = d.plus(pipelineSize(plan, spec, inForce, !offload && sdt == cfg.Precision.CommDType))
	if optimizer {
		od, oh := optimizerSize(plan, cfg.Optimizer.Groups, sdt, world, offload, stage3, paramsOnHost)
		*d, *h = d.plus(od), h.plus(oh)
	}
	_, _, _, check := stepCheckLayout(len(params), stage3, optimizer)
	*d = d.plus(stepCheckSize(len(params), stage3, optimizer))
	if stage3 {
		pd, ph := paramsSize(plan, params, cfg.Params, run.Gathers, paramsOnHost)
		*d, *h = d.plus(pd), h.plus(ph)
	}

	// One step's collectives.
	w := &est.Wire
	g := max(run.Backwards, 1)
	for b, bp := range plan.Buckets {
		n := g
		if modes[b] == deferred || inWindow != nil && inWindow[b] {
			n = 1
		}
		for range n {
			w.add(KindReduceScatter, bp.Padded*int(comm), world)
		}
	}
	w.add(KindAllReduce, check*4, world)
	if optimizer {
		w.add(KindAllGather, normWords*world*4, world)
	}
	if stage3 {
		for _, b := range setBuckets(plan, params, run.Gathers) {
			for range 2 * g {
				w.add(KindAllGather, plan.Buckets[b].Padded*int(msize), world)
			}
		}
	} else if optimizer {
		for _, bp := range plan.Buckets {
			w.add(KindAllGather, bp.Padded*int(msize), world)
		}
	}
	return est, nil
}

// setBuckets lists, set by set, the buckets each set of gathers spans
// (nil: each parameter alone), as a pass of the framework gathers them.
func setBuckets(plan *Plan, params []Param, sets [][]int) []int {
	if sets == nil {
		for p := range params {
			sets = append(sets, []int{p})
		}
	}
	var out []int
	for _, set := range sets {
		seen := map[int]bool{}
		for _, p := range set {
			if b := plan.ParamBucket[p]; b >= 0 && !seen[b] {
				seen[b] = true
				out = append(out, b)
			}
		}
	}
	return out
}

// resolveForEstimate resolves cfg as New does, without asking for the
// parameters' memory: the memory check runs on the parameters without it
// and without the optimizer, and the optimizer's own check on all.
func resolveForEstimate(cfg *Config, params []Param) (DType, error) {
	opt := cfg.Optimizer
	bare := make([]Param, len(params))
	for i, p := range params {
		bare[i] = Param{Name: p.Name, Count: p.Count, Shape: p.Shape, DType: p.DType, Frozen: p.Frozen}
	}
	cfg.Optimizer = OptimizerPolicy{}
	model, err := cfg.resolve(bare)
	cfg.Optimizer = opt
	if err != nil {
		return 0, err
	}
	if err := cfg.Optimizer.check(params); err != nil {
		return 0, err
	}
	return model, nil
}

// TransformerShape is the shape of a Llama-like decoder (a shape, not a
// model: it lists the parameters Estimate needs): an embedding, Layers
// blocks of attention (q, k, v, o, with KVHeads key and value heads of
// Hidden/Heads each) and a gated MLP (gate, up, down of FFN), an RMSNorm
// before each, a final norm and an output head (unless TiedEmbeddings).
// Llama-2 7B is {Hidden: 4096, Layers: 32, Vocab: 32000, FFN: 11008, Heads:
// 32}: 6.74B parameters; 70B {8192, 80, 32000, 28672, 64, 8}: 68.98B.
type TransformerShape struct {
	Hidden         int  // the model width
	Layers         int  // decoder blocks
	Vocab          int  // tokens of the embedding and the head
	FFN            int  // the MLP's inner width
	Heads          int  // attention heads
	KVHeads        int  // key and value heads (grouped-query attention; 0: Heads)
	TiedEmbeddings bool // the output head is the embedding
}

// Transformer is the old name of TransformerShape.
//
// Deprecated: use TransformerShape; Transformer goes at the next release.
type Transformer = TransformerShape

// Params lists the decoder's parameters in registration order (the
// forward's: embedding, blocks, final norm, head), named as Hugging Face
// names Llama's, each of dtype dt.
func (t TransformerShape) Params(dt DType) ([]Param, error) {
	kv := t.KVHeads
	if kv == 0 {
		kv = t.Heads
	}
	switch {
	case t.Hidden < 1 || t.Layers < 0 || t.Vocab < 1 || t.FFN < 1 || t.Heads < 1:
		return nil, errorf(ErrParam, "TransformerShape %+v: give Hidden, Vocab, FFN and Heads ≥ 1 and Layers ≥ 0", t)
	case t.Hidden%t.Heads != 0 || kv < 1 || t.Heads%kv != 0:
		return nil, errorf(ErrParam, "TransformerShape %+v: Heads must divide Hidden, and KVHeads Heads", t)
	case !dt.valid():
		return nil, errorf(ErrDType, "TransformerShape.Params(%v); use FP32, BF16 or FP16", dt)
	}
	kvDim := t.Hidden / t.Heads * kv
	var out []Param
	add := func(name string, shape ...int) {
		n := 1
		for _, d := range shape {
			n *= d
		}
		out = append(out, Param{Name: name, Count: n, Shape: shape, DType: dt})
	}
	add("model.embed_tokens.weight", t.Vocab, t.Hidden)
	for l := range t.Layers {
		at := fmt.Sprintf("model.layers.%d.", l)
		add(at+"input_layernorm.weight", t.Hidden)
		add(at+"self_attn.q_proj.weight", t.Hidden, t.Hidden)
		add(at+"self_attn.k_proj.weight", kvDim, t.Hidden)
		add(at+"self_attn.v_proj.weight", kvDim, t.Hidden)
		add(at+"self_attn.o_proj.weight", t.Hidden, t.Hidden)
		add(at+"post_attention_layernorm.weight", t.Hidden)
		add(at+"mlp.gate_proj.weight", t.FFN, t.Hidden)
		add(at+"mlp.up_proj.weight", t.FFN, t.Hidden)
		add(at+"mlp.down_proj.weight", t.Hidden, t.FFN)
	}
	add("model.norm.weight", t.Hidden)
	if !t.TiedEmbeddings {
		add("lm_head.weight", t.Vocab, t.Hidden)
	}
	return out, nil
}

// CountParams lists a model known by its size alone, as DeepSpeed's
// estimators of a hypothetical model take it: total parameters of dtype dt
// in parameters of largest elements each, the last one the remainder.
func CountParams(total, largest int, dt DType) ([]Param, error) {
	switch {
	case total < 1 || largest < 1:
		return nil, errorf(ErrParam, "CountParams(%d, %d): give a total and a largest layer of at least one parameter", total, largest)
	case largest > total:
		return nil, errorf(ErrParam, "CountParams(%d, %d): the largest layer cannot exceed the total", total, largest)
	case !dt.valid():
		return nil, errorf(ErrDType, "CountParams(%v); use FP32, BF16 or FP16", dt)
	}
	out := make([]Param, 0, (total+largest-1)/largest)
	for at := 0; at < total; at += largest {
		n := min(largest, total-at)
		out = append(out, Param{Name: fmt.Sprintf("layer%d", len(out)), Count: n, DType: dt})
	}
	return out, nil
}
