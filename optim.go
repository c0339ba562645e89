package zero

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
)

// rangeFor sets the AdamW settings of step t (from 1) in the form
// zero_adamw_elem uses, computed in double and rounded once, as PyTorch
// computes its Python-float scalars.
func (o AdamW) rangeFor(r *optRange, t int) {
	bc1 := 1 - math.Pow(o.Beta1, float64(t))
	bc2 := 1 - math.Pow(o.Beta2, float64(t))
	r.decay = float32(1 - o.LR*o.WeightDecay)
	r.step = float32(o.LR / bc1)
	r.beta1c = float32(1 - o.Beta1)
	r.beta2 = float32(o.Beta2)
	r.beta2c = float32(1 - o.Beta2)
	r.bc2sqrt = float32(math.Sqrt(bc2))
	r.eps = float32(o.Eps)
	if o.AMSGrad {
		r.flags |= optAMSGrad
	}
}

func (o SGD) rangeFor(r *optRange, t int) {
	r.decay = float32(o.WeightDecay)
	r.step = float32(o.LR)
	r.beta1c = float32(o.Momentum)
	r.beta2 = float32(1 - o.Dampening)
	if o.Nesterov {
		r.flags |= optNesterov
	}
	if t == 1 {
		r.flags |= optFirst
	}
}

// lossScaler is DeepSpeed's DynamicLossScaler (deepspeed/runtime/fp16/
// loss_scaler.py, consecutive_hysteresis false), step by step. Its scale
// is DeepSpeed's: that of the step's loss, the mean of its G backwards'
// losses, so each backward carries scale/G (optState.lossScale).
type lossScaler struct {
	dynamic    bool
	scale      float64
	window     int
	hysteresis int
	min        float64

	curHysteresis int
	iter          int
	lastOverflow  int
}

// newLossScaler builds the scaler of a resolved LossScale: dynamic
// exactly when Static is 0.
func newLossScaler(c LossScale) lossScaler {
	if c.Static > 0 {
		return lossScaler{scale: c.Static}
	}
	return lossScaler{dynamic: true, scale: c.Initial, window: c.Window, hysteresis: c.Hysteresis, min: c.Min,
		curHysteresis: c.Hysteresis, lastOverflow: -1}
}

// update moves the scale after a step that did or did not overflow: an
// overflow spends the hysteresis, then halves (never below min); the
// scale doubles, and the hysteresis is given back, once a multiple of
// window clean steps has followed the last overflow, that step not
// counted (DeepSpeed's stable interval, iter − last overflow − 1).
func (s *lossScaler) update(overflow bool) {
	if !s.dynamic {
		return
	}
	if overflow {
		if s.hysteresis == 1 || s.curHysteresis == 1 {
			s.scale = max(s.scale/2, s.min)
		} else {
			s.curHysteresis--
		}
		s.lastOverflow = s.iter
	} else if stable := s.iter - s.lastOverflow - 1; stable > 0 && stable%s.window == 0 {
		s.curHysteresis = s.hysteresis
		s.scale *= 2
	}
	s.iter++
}

// optState is the optimizer's part of an engine: the fp32 master shard, the
// moments, the model-dtype shard that the parameters are gathered from, and
// each parameter's step count. It lives in its home's memory (the device's,
// or with offload the host's) and runs its fused pass there.
type optState struct {
	dev    Device
	comm   Comm
	plan   *Plan
	params []Param
	rank   int
	world  int
	s      Stream // the engine's reduce stream: the step's collectives and device work
	home   optimizerHome

	groups   []Optimizer // the settings the pass runs with
	base     []Optimizer // the settings given at New or by SetGroup
	schedule Schedule    // nil: groups are base
	// scheduled counts the optimizer steps taken (skipped ones not), the
	// schedule's t
	scheduled int
	kind      optKind
	master    Tensor // fp32, the plan's shard layout
	m, v      Tensor // AdamW moments; m is SGD's momentum buffer
	vmax      Tensor // AdamW amsgrad
	model     Tensor // model dtype: the new parameters, gathered from here
	// sharedModel: model is the stage-3 parameter shard, not the optimizer's
	sharedModel bool
	steps       []int // per parameter: optimizer steps taken
	scaler      lossScaler
	// scaleDiv is G, fixed, with fp16: each backward carries the scale of
	// the step's mean loss divided by it, as in DeepSpeed (1 otherwise)
	scaleDiv float64
	// groupsDigest hashes the groups' settings, compared across ranks at
	// each Step
	groupsDigest  uint64
	clip          float64
	keepNonFinite bool
	norm          Tensor // fp32, normWords per rank: Step's all-gather of the overflow flag and the sums of squares
	ranges        []optRange
	gather        *bufferPool // model-dtype bucket buffers the parameters are gathered in
	mem           memoryMeter // the optimizer's device bytes
	sent          CommCounters
	clock         stopwatch  // times the pass and the all-gather
	last          stepResult // the last step's, for the stats
}

// optimizerHome is where the optimizer's fp32 state lives and its fused
// pass runs: device memory (deviceHome, below) or, with offload, page-locked
// host memory (offload.go).
type optimizerHome interface {
	allocator
	// side is where the state is worked on, for a caller on device stream s.
	side(s Stream) (Device, Stream)
	// loadMaster fills master from the model-dtype shard model (device
	// memory, written on s) and waits for it.
	loadMaster(s Stream, master, model Tensor) error
	// pass runs the fused optimizer over b's ranges and leaves the new
	// model-dtype parameters in model, on the device. It returns, per
	// bucket, the event after which model holds them there; nil: in order
	// on s. A 16-bit gradient shard b.g is read bucket by bucket through an
	// fp32 scratch.
	pass(s Stream, kind optKind, b optTensors, ranges []optRange, gscale float32, model Tensor) ([]Event, error)
}

// eachBucket calls fn, in bucket order, for every bucket that holds one of
// ranges (sorted here by offset), with those ranges rebased to the bucket's
// part of the shard.
func eachBucket(plan *Plan, ranges []optRange, fn func(bi int, bp BucketPlan, part []optRange) error) error {
	slices.SortFunc(ranges, func(x, y optRange) int { return cmp.Compare(x.offset, y.offset) })
	var part []optRange
	for bi, bp := range plan.Buckets {
		lo, hi := int64(bp.ShardOffset), int64(bp.ShardOffset+bp.Shard)
		part = part[:0]
		for len(ranges) > 0 && ranges[0].offset < hi {
			r := ranges[0]
			r.offset -= lo
			part = append(part, r)
			ranges = ranges[1:]
		}
		if len(part) == 0 {
			continue
		}
		if err := fn(bi, bp, part); err != nil {
			return err
		}
	}
	return nil
}

// widened runs fn on d's stream s with bucket bi's part of a 16-bit shard
// g widened into scratch (fp32); fn gets the widened part.
func widened(d Device, s Stream, g, scratch Tensor, bp BucketPlan, fn func(part Tensor) error) error {
	part := scratch.slice(0, bp.Shard)
	if err := d.cast(s, part, g.slice(bp.ShardOffset, bp.Shard), 1); err != nil {
		return err
	}
	return fn(part)
}

// deviceHome keeps the state in device memory and runs the pass on the
// engine's stream.
type deviceHome struct {
	dev     Device
	plan    *Plan
	mem     *memoryMeter // the optimizer's device bytes
	scratch Tensor       // fp32, the largest bucket shard, for a 16-bit gradient shard
}

func (h *deviceHome) Alloc(n int, d DType) (Tensor, error) {
	t, err := h.dev.Alloc(n, d)
	if err == nil {
		h.mem.add(int64(t.Bytes()))
	}
	return t, err
}

func (h *deviceHome) Free(t Tensor) error {
	h.mem.add(-int64(t.Bytes()))
	return h.dev.Free(t)
}

func (h *deviceHome) side(s Stream) (Device, Stream) { return h.dev, s }

func (h *deviceHome) loadMaster(s Stream, master, model Tensor) error {
	if err := h.dev.cast(s, master, model, 1); err != nil {
		return err
	}
	return s.Sync()
}

// scratchFor is the fp32 scratch a 16-bit gradient shard is read through.
func (h *deviceHome) scratchFor(g Tensor) (Tensor, error) {
	if g.dtype == FP32 || h.scratch.ptr != 0 {
		return h.scratch, nil
	}
	var err error
	h.scratch, err = h.Alloc(maxShardElems(h.plan), FP32)
	return h.scratch, err
}

func (h *deviceHome) pass(s Stream, kind optKind, b optTensors, ranges []optRange, gscale float32, model Tensor) ([]Event, error) {
	b.out = model
	if b.g.dtype == FP32 {
		return nil, h.dev.optimize(s, kind, b, ranges, gscale)
	}
	scratch, err := h.scratchFor(b.g)
	if err != nil {
		return nil, err
	}
	return nil, eachBucket(h.plan, ranges, func(_ int, bp BucketPlan, part []optRange) error {
		return widened(h.dev, s, b.g, scratch, bp, func(g Tensor) error {
			sub := b.slice(bp.ShardOffset, bp.Shard)
			sub.g = g
			return h.dev.optimize(s, kind, sub, part, gscale)
		})
	})
}

func (h *deviceHome) close() error { return h.Free(h.scratch) }

// optimizerSpec is what the optimizer needs of the engine.
type optimizerSpec struct {
	cfg    Config
	dev    Device
	comm   Comm
	plan   *Plan
	params []Param
	s      Stream
	// home is where the state lives (nil: the device)
	home optimizerHome
	// shared is the stage-3 parameter shard, already loaded, which the pass
	// writes (nil below stage 3); load fills a model-dtype shard with the
	// parameters otherwise.
	shared *Tensor
	load   func(pool *bufferPool, into Tensor) error
}

// newOptimizer allocates the optimizer's shards and fills the master shard
// from the parameters (rank 0's, unless NoBroadcast).
func newOptimizer(sp optimizerSpec) (*optState, error) {
	groups := sp.cfg.Optimizer.Groups
	o := &optState{dev: sp.dev, comm: sp.comm, plan: sp.plan, params: sp.params, rank: sp.comm.Rank(), world: sp.comm.Size(), s: sp.s, home: sp.home,
		groups: append([]Optimizer(nil), groups...), base: append([]Optimizer(nil), groups...), schedule: sp.cfg.Optimizer.Schedule,
		kind: groups[0].kind(), steps: make([]int, len(sp.params)),
		scaler: newLossScaler(sp.cfg.Precision.LossScale), scaleDiv: lossScaleDivisor(sp.plan.modelDType(), sp.cfg.Grads.AccumSteps),
		clip: sp.cfg.Optimizer.Clip, keepNonFinite: sp.cfg.Precision.KeepNonFinite}
	o.groupsDigest = recordDigest(groupsRecord(o.base), "")
	if o.home == nil {
		o.home = &deviceHome{dev: o.dev, plan: o.plan, mem: &o.mem}
	}
	n, dt := sp.plan.ShardElems, sp.plan.modelDType()
	o.gather = newBufferPool(o.dev, dt, &o.mem)
	var err error
	if o.master, err = o.home.Alloc(n, FP32); err != nil {
		return o, err
	}
	if sp.shared != nil {
		o.model, o.sharedModel = *sp.shared, true
	} else {
		if o.model, err = o.dev.Alloc(n, dt); err != nil {
			return o, err
		}
		o.mem.add(int64(o.model.Bytes()))
		if err := sp.load(o.gather, o.model); err != nil {
			return o, err
		}
	}
	if o.kind == optAdamW {
		if o.m, err = o.home.Alloc(n, FP32); err != nil {
			return o, err
		}
		if o.v, err = o.home.Alloc(n, FP32); err != nil {
			return o, err
		}
	}
	if o.norm, err = o.dev.Alloc(normWords*o.world, FP32); err != nil {
		return o, err
	}
	return o, o.home.loadMaster(o.s, o.master, o.model)
}

// currentGroups are the groups' settings as SetGroup left them; digest
// hashes them; lossScale is the scale each of the next backwards carries.
func (o *optState) currentGroups() []Optimizer { return o.base }
func (o *optState) digest() uint64             { return o.groupsDigest }
func (o *optState) lossScale() float64         { return o.scaler.scale / o.scaleDiv }

// lossScaleDivisor is what the scale of a step's mean loss is divided by
// for each backward: G with fp16 and Grads.AccumSteps G, as DeepSpeed
// scales loss/G; 1 where G is counted (not known before Step) or the
// model is not fp16 (its scale is 1, or a static scale taken as given).
func lossScaleDivisor(model DType, accumSteps int) float64 {
	if model == FP16 && accumSteps > 0 {
		return float64(accumSteps)
	}
	return 1
}

// setGroup replaces group g's settings (SetGroup).
func (o *optState) setGroup(g int, opt Optimizer) error {
	if g < 0 || g >= len(o.groups) {
		return errorf(ErrParam, "SetGroup(%d): the groups are 0..%d", g, len(o.groups)-1)
	}
	if opt == nil || opt.kind() != o.kind {
		return errorf(ErrConfig, "SetGroup(%d, %T): the engine's groups are %T", g, opt, o.groups[0])
	}
	if err := opt.check(fmt.Sprintf("SetGroup(%d)", g)); err != nil {
		return err
	}
	if o.schedule != nil {
		if err := checkScheduled(o.schedule, o.scheduled, g, opt); err != nil {
			return err
		}
	}
	o.base[g], o.groups[g] = opt, opt
	o.groupsDigest = recordDigest(groupsRecord(o.base), "")
	return nil
}

// stepResult is what an optimizer step reports.
type stepResult struct {
	// lrs is each group's learning rate in the step: the schedule's for
	// the step's t (a skipped step does not advance t)
	lrs     []float64
	skipped bool
	norm    float64
	scale   float64
	// device time of the optimizer pass and of the parameters' all-gather
	optimizeTime, gatherTime time.Duration
}

// rates gives each group's learning rate at the schedule's current t.
func (o *optState) rates() []float64 {
	lrs := make([]float64, len(o.groups))
	for g, opt := range o.groups {
		if o.schedule != nil {
			opt = o.schedule.At(o.scheduled, o.base[g])
		}
		lrs[g] = opt.rate()
	}
	return lrs
}

// stateNeeds is which fp32 state tensors of the shard's size groups need
// beside the master: m (AdamW's first moment; SGD's momentum buffer, where
// a group has momentum), v (AdamW's second moment) and vmax (amsgrad's
// running maximum). The rule is this one, for the constructor, the first
// step, a load and the estimate.
type stateNeeds struct{ m, v, vmax bool }

func stateNeedsOf(groups []Optimizer) stateNeeds {
	var n stateNeeds
	for _, g := range groups {
		switch g := g.(type) {
		case AdamW:
			n.m, n.v = true, true
			n.vmax = n.vmax || g.AMSGrad
		case SGD:
			n.m = n.m || g.Momentum != 0
		}
	}
	return n
}

// tensors counts the state tensors needed.
func (n stateNeeds) tensors() int {
	c := 0
	for _, need := range []bool{n.m, n.v, n.vmax} {
		if need {
			c++
		}
	}
	return c
}

// optimizerSize is what the optimizer holds from its first step on: in its
// home (the host with offload) the fp32 master and the state the groups
// need, and on the device the norm's all-gather; a 16-bit shard's fp32
// scratch where the device is the home (offload keeps its own); below
// stage 3 (sharedModel: the parameter shard is the model-dtype shard) the
// new parameters' shard and the bucket buffer they are gathered in, which
// loading also uses at New; with offload the host's copy of the new
// parameters, unless the step writes the host's parameter shard
// (paramsOnHost).
func optimizerSize(plan *Plan, groups []Optimizer, shardDType DType, world int, onHost, sharedModel, paramsOnHost bool) (DeviceBytes, HostBytes) {
	shard, msize := int64(plan.ShardElems), int64(plan.modelDType().Size())
	master, state := shard*4, int64(stateNeedsOf(groups).tensors())*shard*4
	d := DeviceBytes{Control: normWords * int64(world) * 4}
	var h HostBytes
	if onHost {
		h.Master, h.OptimizerState = master, state
		if shard > 0 && !paramsOnHost {
			h.NewParams = shard * msize
		}
	} else {
		d.Master, d.OptimizerState = master, state
		if shardDType != FP32 {
			d.GradScratch = int64(maxShardElems(plan)) * 4
		}
	}
	if !sharedModel {
		d.NewParams = shard * msize
		d.ParamGather = int64(plan.MaxBucket()) * msize
	}
	return d, h
}

// ensureState allocates the state that only some settings need (SGD's
// momentum buffer, amsgrad's running max) the first time a step needs it.
func (o *optState) ensureState(n int) error {
	return o.allocState(stateNeedsOf(o.groups), n)
}

// allocState allocates the state tensors in need that are not there yet.
func (o *optState) allocState(need stateNeeds, n int) error {
	if n == 0 {
		return nil
	}
	for _, x := range []struct {
		t    *Tensor
		want bool
	}{{&o.m, need.m}, {&o.v, need.v}, {&o.vmax, need.vmax}} {
		if x.want && x.t.ptr == 0 {
			var err error
			if *x.t, err = o.home.Alloc(n, FP32); err != nil {
				return err
			}
		}
	}
	return nil
}

// normWords is what each rank contributes to the norm's all-gather: the
// overflow flag and its sum of squares as (mantissa high, mantissa low,
// exponent).
const normWords = 4

// step is the optimizer's part of Step, after the reductions: the overflow
// and the global norm of grads (the gradient shard, in the home's memory;
// sumsq is this rank's sum of squares of it, from the pipeline's sink),
// agreed by every rank in one all-gather; the decision to skip; the fused
// optimizer pass over the master shard, with the mean's 1/G, the loss
// scale and the clipping folded into one gradient factor; then the new
// parameters, gathered bucket by bucket into their memory (below stage 3).
// Nothing of the master, the moments, the step counts or the parameters
// changes before the optimizer pass is enqueued; a skipped step changes only
// the loss scale.
func (o *optState) step(grads Tensor, sumsq float64, readScale float32, used []bool, overflowFlag float32) (stepResult, error) {
	s := o.s
	_, ss := o.home.side(s)
	res := stepResult{scale: o.scaler.scale}
	// Each rank's sum of squares travels as a mantissa split in two fp32
	// halves (48 of its 53 bits) and an exponent (its whole range), in one all-gather with the overflow
	// flag; every rank adds them in rank order in float64. A sum across
	// ranks in fp32 would overflow for finite gradients whose norm passes
	// 1.8e19.
	m, exp := math.Frexp(sumsq)
	hi := float32(m)
	mine := []float32{overflowFlag, hi, float32(m - float64(hi)), float32(exp)}
	part := o.norm.slice(o.rank*normWords, normWords)
	if err := o.dev.copy(s, part, Float32s(mine)); err != nil {
		return res, err
	}
	if err := o.comm.AllGather(s, part, o.norm); err != nil {
		return res, err
	}
	o.sent.add(KindAllGather, o.norm.Bytes(), o.world)
	all := make([]float32, o.norm.count)
	if err := o.dev.copy(s, Float32s(all), o.norm); err != nil {
		return res, err
	}
	if err := s.Sync(); err != nil {
		return res, err
	}
	overflow, total := false, 0.0
	for r := range o.world {
		w := all[r*normWords : (r+1)*normWords]
		overflow = overflow || w[0] != 0
		total += math.Ldexp(float64(w[1])+float64(w[2]), int(w[3]))
	}
	res.norm = math.Sqrt(total) * float64(readScale) / o.lossScale()
	res.lrs = o.rates()
	finite := !overflow && !math.IsInf(res.norm, 0) && !math.IsNaN(res.norm)
	if !finite && (o.plan.modelDType() == FP16 || !o.keepNonFinite || o.clip > 0) {
		res.skipped = true
		o.scaler.update(true)
		o.last = res
		return res, nil
	}
	coef := 1.0
	if o.clip > 0 && res.norm > o.clip {
		coef = res.norm / o.clip
	}
	gscale := float32(float64(readScale) / o.lossScale() / coef)
	if o.schedule != nil {
		for g := range o.groups {
			if err := checkScheduled(o.schedule, o.scheduled, g, o.base[g]); err != nil {
				return res, err
			}
			o.groups[g] = o.schedule.At(o.scheduled, o.base[g])
		}
	}
	o.ranges = o.ranges[:0]
	for p, q := range o.params {
		if !used[p] || o.plan.ParamBucket[p] < 0 {
			continue
		}
		rg := o.plan.shardRange(p, o.rank)
		if rg.Count == 0 {
			continue
		}
		r := optRange{offset: int64(rg.ShardOffset), count: int64(rg.Count)}
		o.groups[q.Group].rangeFor(&r, o.steps[p]+1)
		o.ranges = append(o.ranges, r)
	}
	if err := o.ensureState(o.plan.ShardElems); err != nil {
		return res, err
	}
	b := optTensors{p: o.master, g: grads, m: o.m, v: o.v, vmax: o.vmax}
	t0, err := o.clock.mark(ss)
	if err != nil {
		return res, err
	}
	ready, err := o.home.pass(ss, o.kind, b, o.ranges, gscale, o.model)
	if err != nil {
		return res, err
	}
	// committed: the pass is enqueued
	for p := range o.params {
		if used[p] && o.plan.ParamBucket[p] >= 0 {
			o.steps[p]++
		}
	}
	o.scaler.update(false)
	o.scheduled++
	t1, err := o.clock.mark(ss)
	var g0 Event
	if err == nil {
		g0, err = o.clock.mark(s)
	}
	if err == nil && !o.sharedModel { // stage 3 keeps its shard: the next gathers read it
		err = o.gatherParams(used, ready)
	}
	for b := 0; err == nil && o.sharedModel && b < len(ready); b++ {
		err = s.Wait(ready[b])
	}
	var t2 Event
	if err == nil {
		t2, err = o.clock.mark(s)
	}
	if err == nil { // the parameters are written before Step returns
		err = t2.Sync()
	}
	if err == nil {
		res.optimizeTime, err = Elapsed(t0, t1)
	}
	if err == nil {
		res.gatherTime, err = Elapsed(g0, t2)
	}
	if err == nil {
		o.clock.release(t0, t1, g0, t2)
	}
	o.last = res
	return res, err
}

// gatherParams all-gathers each bucket that holds a used parameter from the
// model-dtype shards into a pooled bucket buffer and copies the used
// parameters into their memory; two buffers ping-pong, so a bucket's copy
// overlaps the next one's all-gather. ready, where given, holds per bucket
// the event after which its shard is on the device.
func (o *optState) gatherParams(used []bool, ready []Event) error {
	s := o.s
	for b, bp := range o.plan.Buckets {
		segs := bucketSegments(o.plan, o.params, b, used)
		anyUsed := false
		for _, p := range bp.Params {
			anyUsed = anyUsed || used[p]
		}
		if !anyUsed { // the same on every rank: used is agreed
			continue
		}
		buf, err := o.gather.get(o.plan.MaxBucket())
		if err != nil {
			return err
		}
		t := buf.t.slice(0, bp.Padded)
		err = s.Wait(buf.free)
		if err == nil && ready != nil {
			err = s.Wait(ready[b])
		}
		if err == nil {
			err = o.comm.AllGather(s, o.model.slice(bp.ShardOffset, bp.Shard), t)
		}
		if err == nil {
			o.sent.add(KindAllGather, t.Bytes(), o.world)
			err = o.dev.unflatten(s, t, segs)
		}
		var done Event
		if err == nil {
			done, err = record(s)
		}
		o.gather.put(buf, done)
		if err != nil {
			return err
		}
	}
	return nil // the step waits for its last event
}

// report fills the step's optimizer figures and its collectives, and
// starts the next step's count.
func (o *optState) report(st *Stats) error {
	st.Collectives = st.Collectives.Add(o.sent)
	o.sent = CommCounters{}
	st.Skipped, st.GradNorm, st.LossScale, st.LR = o.last.skipped, o.last.norm, o.last.scale, o.last.lrs
	st.OptimizerBytes, st.OptimizerTime = o.mem.cur, o.last.optimizeTime
	st.ControlBytes += int64(o.norm.Bytes())
	if !o.sharedModel { // at stage 3 the parameters' gathers are the window's
		st.ParamGatherTime = o.last.gatherTime
	}
	return nil
}

// close frees the optimizer's memory.
func (o *optState) close() error {
	var errs []error
	errs = append(errs, o.gather.trim(0))
	if !o.sharedModel && o.model.ptr != 0 {
		errs = append(errs, o.dev.Free(o.model))
	}
	if o.norm.ptr != 0 {
		errs = append(errs, o.dev.Free(o.norm))
	}
	for _, t := range []Tensor{o.master, o.m, o.v, o.vmax} {
		if t.ptr != 0 {
			errs = append(errs, o.home.Free(t))
		}
	}
	if h, ok := o.home.(*deviceHome); ok {
		errs = append(errs, h.close())
	}
	return errors.Join(errs...)
}

// ---- checkpoint state -----------------------------------------------------------

// scalerState is the loss scaler's state in a checkpoint. From format
// version 2 its scale is DeepSpeed's, that of the step's mean loss, the same
// at any Grads.AccumSteps. Format 1 saved the scale each backward carried:
// with fp16 and G fixed, 1/G of format 2's (savedLossScale converts it);
// its counters are read as they are, and continue under DeepSpeed's rule,
// which doubles the scale one clean step later than format 1's did.
type scalerState struct {
	Scale         float64 `json:"scale"`
	CurHysteresis int     `json:"cur_hysteresis"`
	Iter          int     `json:"iter"`
	LastOverflow  int     `json:"last_overflow"`
}

// savedLossScale is a saved dynamic scale in this version's terms: a
// format-1 scale is what each backward carried, so with fp16 and G fixed
// it was the scale of the step's mean loss divided by G.
func savedLossScale(scale float64, from scalerOrigin, model DType) float64 {
	if from.version < 2 {
		return scale * lossScaleDivisor(model, from.accumSteps)
	}
	return scale
}

// optGroup is one group's settings in a checkpoint: one of the two.
type optGroup struct {
	AdamW *AdamW `json:"adamw,omitempty"`
	SGD   *SGD   `json:"sgd,omitempty"`
}

// optCheckpoint is the optimizer's state apart from its tensors.
type optCheckpoint struct {
	Kind      string      `json:"kind"`
	Groups    []optGroup  `json:"groups"`    // as SetGroup left them
	Steps     []int       `json:"steps"`     // per parameter: optimizer steps taken
	Scheduled int         `json:"scheduled"` // the schedule's t
	Scaler    scalerState `json:"loss_scaler"`
}

// stateTensors lists the tensors a checkpoint holds: the fp32 master and
// the moments that exist, then the model-dtype shard (at stage 3 the
// parameter shard).
func (o *optState) stateTensors() []stateTensor {
	d, s := o.home.side(o.s)
	var out []stateTensor
	for _, x := range []struct {
		name string
		t    Tensor
	}{{"master", o.master}, {"m", o.m}, {"v", o.v}, {"vmax", o.vmax}} {
		if x.t.ptr != 0 || (x.name == "master" && x.t.count == 0) {
			out = append(out, stateTensor{x.name, x.t, d, s})
		}
	}
	return append(out, stateTensor{"model", o.model, o.dev, o.s})
}

func (o *optState) checkpointState() optCheckpoint {
	c := optCheckpoint{Kind: "adamw", Steps: slices.Clone(o.steps), Scheduled: o.scheduled,
		Scaler: scalerState{o.scaler.scale, o.scaler.curHysteresis, o.scaler.iter, o.scaler.lastOverflow}}
	if o.kind == optSGD {
		c.Kind = "sgd"
	}
	for _, g := range o.base {
		switch g := g.(type) {
		case AdamW:
			c.Groups = append(c.Groups, optGroup{AdamW: &g})
		case SGD:
			c.Groups = append(c.Groups, optGroup{SGD: &g})
		}
	}
	return c
}

// restorable checks a checkpoint's optimizer state against this engine's
// and returns its groups, ready to be set.
func (o *optState) restorable(where string, c optCheckpoint) ([]Optimizer, error) {
	if len(c.Steps) != len(o.params) {
		return nil, errorf(ErrCheckpoint, "%s: the checkpoint counts steps of %d parameters, the engine has %d", where, len(c.Steps), len(o.params))
	}
	want := "adamw"
	if o.kind == optSGD {
		want = "sgd"
	}
	if c.Kind != want {
		return nil, errorf(ErrCheckpoint, "%s: the checkpoint's optimizer is %s, the engine's %s; build the engine with the checkpoint's optimizer, or load with WeightsOnly", where, c.Kind, want)
	}
	if len(c.Groups) != len(o.groups) {
		return nil, errorf(ErrCheckpoint, "%s: the checkpoint has %d optimizer groups, the engine %d", where, len(c.Groups), len(o.groups))
	}
	groups := make([]Optimizer, len(c.Groups))
	for i, g := range c.Groups {
		switch {
		case g.AdamW != nil && o.kind == optAdamW:
			groups[i] = made(*g.AdamW)
		case g.SGD != nil && o.kind == optSGD:
			groups[i] = made(*g.SGD)
		default:
			return nil, errorf(ErrCheckpoint, "%s: the checkpoint's group %d is not a %s group", where, i, want)
		}
		if err := groups[i].check(fmt.Sprintf("%s: the checkpoint's group %d", where, i)); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrCheckpoint, err)
		}
	}
	return groups, nil
}

// prepareLoad allocates the state tensors the loaded groups need (SGD's
// momentum, amsgrad's maximum) before anything is overwritten, and returns
// every state tensor to fill.
func (o *optState) prepareLoad(groups []Optimizer) ([]stateTensor, error) {
	if err := o.allocState(stateNeedsOf(groups), o.plan.ShardElems); err != nil {
		return nil, err
	}
	return o.stateTensors(), nil
}

// scalerOrigin is what a saved scaler state means, beside the state: the
// checkpoint's format version, and the Grads.AccumSteps it was saved with.
type scalerOrigin struct {
	version, accumSteps int
}

// restore sets what a checkpoint holds beside its tensors (weightsOnly:
// the engine's own groups, no steps taken, the scaler as New left it).
func (o *optState) restore(c optCheckpoint, groups []Optimizer, weightsOnly bool, fresh lossScaler, from scalerOrigin) error {
	if weightsOnly {
		clear(o.steps)
		o.scheduled, o.scaler = 0, fresh
		return nil
	}
	copy(o.steps, c.Steps)
	o.scheduled = c.Scheduled
	if o.scaler.dynamic { // a static scale is the Config's
		o.scaler.scale = savedLossScale(c.Scaler.Scale, from, o.plan.modelDType())
	}
	o.scaler.curHysteresis, o.scaler.iter, o.scaler.lastOverflow = c.Scaler.CurHysteresis, c.Scaler.Iter, c.Scaler.LastOverflow
	copy(o.base, groups)
	copy(o.groups, groups)
	o.groupsDigest = recordDigest(groupsRecord(o.base), "")
	return nil
}

// publish writes the loaded parameters into their memory: below stage 3,
// gathered from the model-dtype shard as a step does; at stage 3 the
// shard is the parameters.
func (o *optState) publish() error {
	if o.sharedModel {
		return o.s.Sync()
	}
	used := make([]bool, len(o.params))
	for p := range used {
		used[p] = true
	}
	if err := o.gatherParams(used, nil); err != nil {
		return err
	}
	return o.s.Sync()
}
