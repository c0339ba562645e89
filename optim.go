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

// lossScaler is DeepSpeed's DynamicLossScaler, step by step.
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

// update moves the scale after a step that did or did not overflow.
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
	} else if (s.iter-s.lastOverflow)%s.window == 0 {
		s.curHysteresis = s.hysteresis
		s.scale *= 2
	}
	s.iter++
}

// optState is the optimizer's part of an engine: the fp32 master shard, the
// moments, the model-dtype shard that the parameters are gathered from, and
// each parameter's step count.
type optState struct {
	groups []Optimizer
	kind   optKind
	master Tensor // fp32, the plan's shard layout
	m, v   Tensor // AdamW moments; m is SGD's momentum buffer
	vmax   Tensor // AdamW amsgrad
	model  Tensor // model dtype: the new parameters, gathered from here
	// state is where master and the moments live: the device, or the
	// host's page-locked memory with Offload; there, host is the host's
	// copy of model, which the host optimizer writes and which goes to
	// model bucket by bucket.
	state allocator
	host  Tensor
	// sharedModel: model is the stage-3 parameter shard, not the optimizer's
	sharedModel bool
	steps       []int // per parameter: optimizer steps taken
	scaler      lossScaler
	// groupsDigest hashes the groups' settings, compared across ranks at
	// each Step
	groupsDigest uint64
	norm         Tensor // fp32 pair for Step's all-reduce of (overflow, sum of squares)
	ranges       []optRange
	gather       *bufferPool // model-dtype bucket buffers the parameters are gathered in
	mem          memoryMeter // the optimizer's device bytes
}

// SetGroup replaces group g's hyperparameters from the next Step on
// (learning-rate schedules); the kind must stay the same. Every rank must
// make the same change: the next Step compares the groups across ranks
// (in its first collective, at no extra cost) and refuses on every rank,
// with ErrPlanMismatch naming the setting, where they differ; the window
// is kept, and a SetGroup that makes the ranks agree lets Step go on.
func (e *Engine) SetGroup(g int, o Optimizer) error {
	if err := e.usable("SetGroup"); err != nil {
		return err
	}
	if e.opt == nil {
		return errorf(ErrConfig, "SetGroup on an engine without an optimizer; configure Groups")
	}
	if g < 0 || g >= len(e.opt.groups) {
		return errorf(ErrParam, "SetGroup(%d): the groups are 0..%d", g, len(e.opt.groups)-1)
	}
	if o == nil || o.kind() != e.opt.kind {
		return errorf(ErrConfig, "SetGroup(%d, %T): the engine's groups are %T", g, o, e.opt.groups[0])
	}
	if err := o.check(fmt.Sprintf("SetGroup(%d)", g)); err != nil {
		return err
	}
	e.opt.groups[g] = o
	e.opt.groupsDigest = recordDigest(groupsRecord(e.opt.groups), "")
	return nil
}

// LossScale is the scale the trainer multiplies its loss by for the next
// backwards (1 unless fp16 or a static scale).
func (e *Engine) LossScale() float64 {
	if e.opt == nil {
		return 1
	}
	return e.opt.scaler.scale
}

// stepResult is what an optimizer step reports.
type stepResult struct {
	skipped bool
	norm    float64
	scale   float64
	// device time of the optimizer pass and of the parameters' all-gather
	optimizeTime, gatherTime time.Duration
}

// initOptimizer allocates the optimizer's shards and fills the master shard
// from the parameters, after copying rank 0's to every rank.
func (e *Engine) initOptimizer() error {
	o := &optState{groups: append([]Optimizer(nil), e.cfg.Optimizer.Groups...), kind: e.cfg.Optimizer.Groups[0].kind(), steps: make([]int, len(e.params))}
	o.scaler = newLossScaler(e.cfg.Precision.LossScale)
	o.groupsDigest = recordDigest(groupsRecord(o.groups), "")
	var err error
	e.opt = o
	o.state = e.dev
	if e.off != nil {
		o.state = e.off.mem
		if o.host, err = e.off.mem.Alloc(e.plan.ShardElems, e.plan.dtype); err != nil {
			return err
		}
	}
	o.gather = newBufferPool(e.dev, e.plan.dtype, &o.mem)
	if o.master, err = o.alloc(o.state, e.plan.ShardElems, FP32); err != nil {
		return err
	}
	if e.ps != nil {
		o.model, o.sharedModel = e.ps.shard, true // stage 3: the pass writes the parameter shard
	} else if o.model, err = o.alloc(e.dev, e.plan.ShardElems, e.plan.dtype); err != nil {
		return err
	}
	if o.kind == optAdamW {
		if o.m, err = o.alloc(o.state, e.plan.ShardElems, FP32); err != nil {
			return err
		}
		if o.v, err = o.alloc(o.state, e.plan.ShardElems, FP32); err != nil {
			return err
		}
	}
	if o.norm, err = e.dev.Alloc(normWords*e.world, FP32); err != nil {
		return err
	}
	switch {
	case e.ps != nil: // the parameter shard is filled: the master from it
	case e.off != nil: // the model-dtype shard first: the host's copy mirrors it
		if err := e.loadParams(o.gather, o.model); err != nil {
			return err
		}
	default:
		return e.loadParams(o.gather, o.master)
	}
	return e.masterFrom(o.model)
}

// masterFrom fills the fp32 master shard from the model-dtype shard src on
// the device; with Offload through the host's copy of it, which then
// mirrors src.
func (e *Engine) masterFrom(src Tensor) error {
	o, s := e.opt, e.reduceStream
	if e.off == nil {
		if err := e.dev.cast(s, o.master, src, 1); err != nil {
			return err
		}
		return s.Sync()
	}
	ev, err := s.Record()
	if err == nil {
		ev, err = e.off.transfer(o.host, src, ev, false)
	}
	if err == nil {
		err = e.off.stream.Wait(ev)
	}
	if err == nil {
		err = hostDev.cast(e.off.stream, o.master, o.host, 1)
	}
	if err == nil {
		err = e.off.stream.Sync()
	}
	return err
}

// alloc allocates from mem, counting device bytes in the optimizer's.
func (o *optState) alloc(mem allocator, n int, dt DType) (Tensor, error) {
	t, err := mem.Alloc(n, dt)
	if err == nil {
		if _, device := mem.(Device); device {
			o.mem.add(int64(t.Bytes()))
		}
	}
	return t, err
}

// ensureState allocates the state that only some settings need (SGD's
// momentum buffer, amsgrad's running max) the first time a step needs it.
func (o *optState) ensureState(n int) error {
	need := func(t *Tensor, want bool) error {
		if !want || t.ptr != 0 || n == 0 {
			return nil
		}
		var err error
		*t, err = o.alloc(o.state, n, FP32)
		return err
	}
	momentum, amsgrad := false, false
	for _, r := range o.ranges {
		amsgrad = amsgrad || r.flags&optAMSGrad != 0
		momentum = momentum || (o.kind == optSGD && r.beta1c != 0)
	}
	if err := need(&o.m, momentum); err != nil {
		return err
	}
	return need(&o.vmax, amsgrad)
}

// bucketParams lays out the members of bucket b that have memory, and that
// are used where used is given, as segments of the bucket's flat layout.
func (e *Engine) bucketParams(b int, used []bool) []Segment {
	var segs []Segment
	for _, p := range e.plan.Buckets[b].Params {
		if e.params[p].Data.count == 0 || (used != nil && !used[p]) {
			continue
		}
		segs = append(segs, Segment{Src: e.params[p].Data, Offset: e.plan.ParamOffset[p]})
	}
	return segs
}

// loadParams gives every rank rank 0's parameters (unless NoBroadcast) and
// fills a shard from them, bucket by bucket: the fp32 master shard, or at
// stage 3 the model-dtype parameter shard. pool lends the bucket buffers.
func (e *Engine) loadParams(pool *bufferPool, into Tensor) error {
	s := e.reduceStream
	bcast := !e.cfg.Params.NoBroadcast && e.world > 1
	for b, bp := range e.plan.Buckets {
		buf, err := pool.get(e.plan.MaxBucket())
		if err != nil {
			return err
		}
		t := buf.t.slice(0, bp.Padded)
		segs := e.bucketParams(b, nil)
		err = s.Wait(buf.free)
		if err == nil {
			err = e.dev.zero(s, t)
		}
		if err == nil {
			err = e.dev.flatten(s, t, segs, 1)
		}
		if err == nil && bcast {
			if err = e.comm.Broadcast(s, t, 0); err == nil && e.rank != 0 {
				err = e.dev.unflatten(s, t, segs)
			}
		}
		if err == nil {
			err = e.dev.cast(s, into.slice(bp.ShardOffset, bp.Shard), t.slice(e.rank*bp.Shard, bp.Shard), 1)
		}
		var done Event
		if err == nil {
			done, err = s.Record()
		}
		pool.put(buf, done)
		if err != nil {
			return err
		}
	}
	if bcast { // frozen parameters have no bucket: one broadcast each
		for _, p := range e.params {
			if p.Frozen && p.Data.count > 0 {
				if err := e.comm.Broadcast(s, p.Data, 0); err != nil {
					return err
				}
			}
		}
	}
	return s.Sync()
}

// normWords is what each rank contributes to the norm's all-gather: the
// overflow flag and its sum of squares as (mantissa high, mantissa low,
// exponent).
const normWords = 4

// optimizerStep is the optimizer's part of Step, after the reductions: the
// overflow and the global norm, agreed by every rank in one all-gather; the
// decision to skip; the fused optimizer pass over the master shard, with
// the mean's 1/G, the loss scale and the clipping folded into one gradient
// factor; then the new parameters, gathered bucket by bucket into their
// memory. Nothing of the master, the moments, the step counts or the
// parameters changes before the optimizer pass is enqueued; a skipped step
// changes only the loss scale.
func (e *Engine) optimizerStep(readScale float32, used []bool, overflowFlag float32) (stepResult, error) {
	o, s := e.opt, e.reduceStream
	sd, ss := e.shardSide(s)
	res := stepResult{scale: o.scaler.scale}
	var sumsq float64
	if err := sd.sumSquares(ss, e.pl.shard, &sumsq); err != nil {
		return res, err
	}
	if err := ss.Sync(); err != nil {
		return res, err
	}
	// Each rank's sum of squares travels exactly, as a mantissa split in
	// two fp32 halves and an exponent, in one all-gather with the overflow
	// flag; every rank adds them in rank order in float64. A sum across
	// ranks in fp32 would overflow for finite gradients whose norm passes
	// 1.8e19.
	m, exp := math.Frexp(sumsq)
	hi := float32(m)
	mine := []float32{overflowFlag, hi, float32(m - float64(hi)), float32(exp)}
	part := o.norm.slice(e.rank*normWords, normWords)
	if err := e.dev.copy(s, part, Float32s(mine)); err != nil {
		return res, err
	}
	if err := e.comm.AllGather(s, part, o.norm); err != nil {
		return res, err
	}
	e.pl.sent.add(KindAllGather, o.norm.Bytes(), e.world)
	all := make([]float32, o.norm.count)
	if err := e.dev.copy(s, Float32s(all), o.norm); err != nil {
		return res, err
	}
	if err := s.Sync(); err != nil {
		return res, err
	}
	overflow, total := false, 0.0
	for r := range e.world {
		w := all[r*normWords : (r+1)*normWords]
		overflow = overflow || w[0] != 0
		total += math.Ldexp(float64(w[1])+float64(w[2]), int(w[3]))
	}
	res.norm = math.Sqrt(total) * float64(readScale) / o.scaler.scale
	finite := !overflow && !math.IsInf(res.norm, 0) && !math.IsNaN(res.norm)
	if !finite && (e.plan.dtype == FP16 || !e.cfg.Precision.KeepNonFinite || e.cfg.Optimizer.Clip > 0) {
		res.skipped = true
		o.scaler.update(true)
		return res, nil
	}
	coef := 1.0
	if e.cfg.Optimizer.Clip > 0 && res.norm > e.cfg.Optimizer.Clip {
		coef = res.norm / e.cfg.Optimizer.Clip
	}
	gscale := float32(float64(readScale) / o.scaler.scale / coef)
	o.ranges = o.ranges[:0]
	for p, q := range e.params {
		if !used[p] || e.plan.ParamBucket[p] < 0 {
			continue
		}
		rg := e.plan.shardRange(p, e.rank)
		if rg.Count == 0 {
			continue
		}
		r := optRange{offset: int64(rg.ShardOffset), count: int64(rg.Count)}
		o.groups[q.Group].rangeFor(&r, o.steps[p]+1)
		o.ranges = append(o.ranges, r)
	}
	if err := o.ensureState(e.plan.ShardElems); err != nil {
		return res, err
	}
	b := optTensors{p: o.master, g: e.pl.shard, m: o.m, v: o.v, vmax: o.vmax, out: o.model}
	t0, err := ss.Record()
	if err != nil {
		return res, err
	}
	var ready []Event // with Offload, per bucket: its new parameters are on the device
	if e.off == nil {
		err = sd.optimize(ss, o.kind, b, o.ranges, gscale)
	} else {
		b.out = o.host
		ready, err = e.optimizeOnHost(b, gscale)
	}
	if err != nil {
		return res, err
	}
	// committed: the pass is enqueued
	for p := range e.params {
		if used[p] && e.plan.ParamBucket[p] >= 0 {
			o.steps[p]++
		}
	}
	o.scaler.update(false)
	t1, err := ss.Record()
	var g0 Event
	if err == nil {
		g0, err = s.Record()
	}
	if err == nil && e.ps == nil { // stage 3 keeps its shard: the next gathers read it
		err = e.gatherParams(used, ready)
	}
	for b := 0; err == nil && e.ps != nil && b < len(ready); b++ {
		err = s.Wait(ready[b])
	}
	var t2 Event
	if err == nil {
		t2, err = s.Record()
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
	return res, err
}

// optimizeOnHost runs the optimizer pass on the host shard bucket by
// bucket, each bucket's new parameters copied to the device's model shard
// as soon as they are written, while the host works on the next bucket. It
// returns, per bucket, the event of that copy (nil where this rank updated
// nothing in the bucket).
func (e *Engine) optimizeOnHost(b optTensors, gscale float32) ([]Event, error) {
	o, hs := e.opt, e.off.stream
	slices.SortFunc(o.ranges, func(x, y optRange) int { return cmp.Compare(x.offset, y.offset) })
	ready := make([]Event, len(e.plan.Buckets))
	rs := o.ranges
	var part []optRange
	for bi, bp := range e.plan.Buckets {
		lo, hi := int64(bp.ShardOffset), int64(bp.ShardOffset+bp.Shard)
		part = part[:0]
		for len(rs) > 0 && rs[0].offset < hi {
			r := rs[0]
			r.offset -= lo
			part = append(part, r)
			rs = rs[1:]
		}
		if len(part) == 0 {
			continue
		}
		first, last := part[0].offset, part[len(part)-1].offset+part[len(part)-1].count
		if err := hostDev.optimize(hs, o.kind, b.slice(bp.ShardOffset, bp.Shard), part, gscale); err != nil {
			return nil, err
		}
		written, err := hs.recordUntimed(nil)
		if err != nil {
			return nil, err
		}
		at, n := bp.ShardOffset+int(first), int(last-first)
		if ready[bi], err = e.off.transfer(o.model.slice(at, n), o.host.slice(at, n), written, true); err != nil {
			return nil, err
		}
	}
	return ready, nil
}

// gatherParams all-gathers each bucket that holds a used parameter from the
// model-dtype shards into a pooled bucket buffer and copies the used
// parameters into their memory; two buffers ping-pong, so a bucket's copy
// overlaps the next one's all-gather.
func (e *Engine) gatherParams(used []bool, ready []Event) error {
	o, s := e.opt, e.reduceStream
	for b, bp := range e.plan.Buckets {
		segs := e.bucketParams(b, used)
		anyUsed := false
		for _, p := range bp.Params {
			anyUsed = anyUsed || used[p]
		}
		if !anyUsed { // the same on every rank: used is agreed
			continue
		}
		buf, err := o.gather.get(e.plan.MaxBucket())
		if err != nil {
			return err
		}
		t := buf.t.slice(0, bp.Padded)
		err = s.Wait(buf.free)
		if err == nil && ready != nil {
			err = s.Wait(ready[b])
		}
		if err == nil {
			err = e.comm.AllGather(s, o.model.slice(bp.ShardOffset, bp.Shard), t)
		}
		if err == nil {
			e.pl.sent.add(KindAllGather, t.Bytes(), e.world)
			err = e.dev.unflatten(s, t, segs)
		}
		var done Event
		if err == nil {
			done, err = s.Record()
		}
		o.gather.put(buf, done)
		if err != nil {
			return err
		}
	}
	return nil // the step waits for its last event
}

// close frees the optimizer's memory.
func (o *optState) close(dev Device) error {
	var errs []error
	errs = append(errs, o.gather.trim(0))
	model := o.model
	if o.sharedModel {
		model = Tensor{} // the parameter shard's: freed with it
	}
	for _, t := range []Tensor{model, o.norm} {
		if t.ptr != 0 {
			errs = append(errs, dev.Free(t))
		}
	}
	for _, t := range []Tensor{o.master, o.m, o.v, o.vmax, o.host} {
		if t.ptr != 0 {
			errs = append(errs, o.state.Free(t))
		}
	}
	return errors.Join(errs...)
}
