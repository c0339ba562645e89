package zero

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// Engine is one rank's ZeRO engine. Its methods are called from the rank's
// own goroutine; the engine is not safe for concurrent use.
type Engine struct {
	cfg    Config
	comm   Comm
	dev    Device
	plan   *Plan
	params []Param
	rank   int
	world  int

	// The engine's own streams: reductions (under Overlap) and Step's
	// collectives; gathers of the shards (FullGrads); copies to the host.
	reduceStream, gatherStream, copyStream Stream
	pl                                     *pipeline
	events                                 eventPool // the window's producer events, untimed
	one                                    struct {  // GradReady's batch of one, GradsReady's grouping
		param  [1]int
		grad   [1]Tensor
		order  []int   // buckets of the batch
		groups [][]int // indexes into the batch, per bucket of order
	}
	window Tensor // fp32 pair for Step's check that ranks agree on the window

	opt        *optState    // nil without Config.Groups: Step only reduces
	off        *offloadPath // nil without Config.Offload
	ps         *paramState  // stage 3 with parameter memory: the parameter shards
	co         coalesceState
	slots      windowSlots // where Step's first all-reduce carries what
	usedWindow []bool      // per parameter: reported in this window, on this rank

	// backward state
	inBackward bool
	boundary   bool
	lastStream Stream

	// window state
	backwards int // backwards since the last Step
	stepIndex int
	readScale float32 // the mean's 1/G, applied by whatever reads the shard
	discarded bool    // DiscardGrads dropped the shard's sums: nothing to read until Step
	stats     Stats
	failed    error
	closed    bool
}

// stageModes is how each stage reduces its buckets: ZeRO-1 sums locally
// and reduces once per window; ZeRO-2 and ZeRO-3 stream every backward.
var stageModes = [...]bucketMode{1: local, 2: streamed, 3: streamed}

// New builds the partition plan and the engine for comm's rank. Every rank
// calls it with the same config and parameters. Every check runs before
// any collective or allocation; then ranks compare their settings (all but
// the rank-local ones) and parameters, and a difference is ErrPlanMismatch
// on every rank, naming the setting and both values.
func New(cfg Config, comm Comm, params []Param) (*Engine, error) {
	if comm == nil {
		return nil, errorf(ErrConfig, "nil Comm; pass one from NewLocalGroup or NewNCCL")
	}
	if comm.Size() < 1 {
		return nil, errorf(ErrConfig, "world size %d; a group needs at least one rank", comm.Size())
	}
	if _, err := cfg.resolve(params); err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, comm: comm, dev: comm.Device(), params: append([]Param(nil), params...), rank: comm.Rank(), world: comm.Size()}
	if err := e.init(); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

func (e *Engine) init() error {
	e.plan = newPlan(e.params, e.cfg.BucketBytes, e.world, e.cfg.Align)
	for _, s := range []*Stream{&e.reduceStream, &e.gatherStream, &e.copyStream} {
		var err error
		if *s, err = e.dev.NewStream(); err != nil {
			return err
		}
	}
	if err := checkSettings(e.dev, e.comm, e.reduceStream, settingsRecord(e.cfg, e.params, e.world)); err != nil {
		return err
	}
	if e.cfg.Offload.Optimizer {
		maxShard := 0
		for _, b := range e.plan.Buckets {
			maxShard = max(maxShard, b.Shard)
		}
		var err error
		if e.off, err = newOffloadPath(e.dev, e.copyStream, e.cfg.Precision.CommDType, maxShard, e.cfg.StagingBuffers); err != nil {
			return err
		}
	}
	spec := pipelineSpec{
		rank: e.rank, world: e.world, commDType: e.cfg.Precision.CommDType, overlap: e.cfg.Overlap,
		staging: e.cfg.StagingBuffers, modes: make([]bucketMode, len(e.plan.Buckets)), windowDType: e.cfg.Window.DType,
		prescale: float32(1 / e.cfg.Grads.PredivideFactor), reduceOp: OpSum, postscale: float32(e.cfg.Grads.PredivideFactor),
	}
	for b := range spec.modes {
		spec.modes[b] = stageModes[e.cfg.Stage]
	}
	// The 1/W of the mean goes into the reduction (ncclAvg) where dividing by
	// W is exact, a power of two: the same bits as a sum scaled afterwards,
	// and no overflow of a half-precision sum on the wire. Elsewhere it goes
	// into the accumulate's post-scale. The 1/G is known only at Step.
	if e.cfg.Grads.Reduction == Mean {
		spec.postscale = float32(e.cfg.Grads.PredivideFactor / float64(e.world))
		if e.world&(e.world-1) == 0 {
			spec.reduceOp, spec.postscale = OpAvg, float32(e.cfg.Grads.PredivideFactor)
		}
	}
	var err error
	if e.pl, err = newPipeline(spec, e.plan, e.dev, e.comm, e.reduceStream, e.off); err != nil {
		return err
	}
	// Step's first collective: (G, −G); at stage 3 with parameter shards the
	// references still gathered; with an optimizer the groups' digest and
	// its negation (equal maxima: every rank has the same groups), then
	// whether each parameter was reported on any rank (the optimizer skips
	// the others).
	e.usedWindow = make([]bool, len(e.params))
	at := 2
	e.slots = windowSlots{refs: -1, digest: -1, used: -1}
	if e.cfg.Stage == 3 && hasParamMemory(e.params) {
		e.slots.refs, at = at, at+1
	}
	if len(e.cfg.Optimizer.Groups) > 0 {
		e.slots.digest, e.slots.used, at = at, at+2*digestWords, at+2*digestWords+len(e.params)
	}
	if e.window, err = e.dev.Alloc(at, FP32); err != nil {
		return err
	}
	if e.cfg.Stage == 3 && hasParamMemory(e.params) {
		if err := e.initParamShards(); err != nil {
			return err
		}
	}
	if len(e.cfg.Optimizer.Groups) > 0 {
		return e.initOptimizer()
	}
	return nil
}

// Plan returns the partition plan.
func (e *Engine) Plan() *Plan { return e.plan }

// Rank is this engine's rank in its communicator.
func (e *Engine) Rank() int { return e.rank }

// World is the number of ranks.
func (e *Engine) World() int { return e.world }

func (e *Engine) usable(op string) error {
	if e.closed {
		return errorf(ErrClosed, "%s after Close", op)
	}
	if e.failed != nil {
		return errorf(ErrCollective, "%s: the engine failed earlier and cannot continue: %v", op, e.failed)
	}
	return nil
}

// fail makes the engine refuse every later call with err. It waits for the
// engine's own streams, so no work of the failed call still writes the
// caller's memory once it returns.
func (e *Engine) fail(err error) error {
	if e.failed == nil {
		e.failed = err
		e.drain()
	}
	return err
}

// drain waits for the work on the engine's streams; their errors went to
// the call that enqueued it.
func (e *Engine) drain() {
	for _, s := range []Stream{e.reduceStream, e.gatherStream, e.copyStream} {
		if s != nil {
			s.Sync()
		}
	}
	if e.off != nil {
		e.off.stream.Sync()
	}
}

// SetBoundary(true) before the last backward of a step lets its deferred
// reductions (ZeRO-1's local buckets) overlap with that backward. It lasts
// until EndBackward. Gradients still sum over every backward since the last
// Step: a boundary never drops earlier backwards.
//
// Call it between backwards, at the same point on every rank: whether the
// local buckets are reduced during a backward must be the same on every
// rank. Inside a backward (after this rank's first gradient of it) it has
// no effect on that backward, whose local buckets the next flush (Step)
// reduces; inside a coalesced window or NoSync it has none either: the
// window's end is its boundary.
func (e *Engine) SetBoundary(b bool) {
	if e.inBackward || e.co.active || e.co.noSync {
		return
	}
	e.boundary = b
}

// GradReady hands the engine the gradient of parameter param, written by
// the framework on stream. The engine reads it on that stream, after the
// work already enqueued there. The gradient's memory must stay as it is
// until the returned event fires; work the framework enqueues later on the
// same stream is ordered after it anyway. A nil event (a parameter of zero
// elements) means the memory was never read. The event is the engine's:
// it stays valid until the next Step, which reuses it.
func (e *Engine) GradReady(param int, grad Tensor, stream Stream) (Event, error) {
	e.one.param[0], e.one.grad[0] = param, grad
	ev, err := e.GradsReady(e.one.param[:], e.one.grad[:], stream)
	e.one.grad[0] = Tensor{} // do not keep the framework's memory alive
	return ev, err
}

// GradsReady is GradReady for several gradients that the framework wrote on
// one stream: the engine reads them with one kernel call per bucket instead
// of one per gradient. Either every gradient is taken or, on an error, none.
func (e *Engine) GradsReady(params []int, grads []Tensor, stream Stream) (Event, error) {
	if err := e.usable("GradReady"); err != nil {
		return nil, err
	}
	if err := e.checkGrads(params, grads, stream); err != nil {
		return nil, err
	}
	if !e.inBackward && e.co.flushNext {
		e.boundary = true // the backward after NoSync reduces as it goes
	}
	e.inBackward = true
	e.lastStream = stream
	// Group by bucket, in order of first appearance (a batch spans few
	// buckets), in slices the engine keeps from call to call.
	order, groups := e.one.order[:0], e.one.groups
	for i, p := range params {
		b := e.plan.ParamBucket[p]
		if b < 0 {
			continue
		}
		k := slices.Index(order, b)
		if k < 0 {
			k = len(order)
			order = append(order, b)
			if k == len(groups) {
				groups = append(groups, nil)
			}
			groups[k] = groups[k][:0]
		}
		groups[k] = append(groups[k], i)
	}
	e.one.order, e.one.groups = order, groups
	if len(order) == 0 {
		return nil, nil // only empty parameters: nothing to read
	}
	for k, b := range order {
		if err := e.pl.take(b, groups[k], params, grads, stream); err != nil {
			return nil, e.fail(err)
		}
	}
	ev, err := e.events.record(stream)
	if err != nil {
		return nil, e.fail(err)
	}
	for k, b := range order {
		e.pl.produced(b, groups[k], params, stream, ev)
	}
	if e.off != nil {
		e.off.producers[stream] = ev
	}
	for _, p := range params {
		e.usedWindow[p] = true
	}
	if err := e.pl.issueReady(stream, false, e.boundary); err != nil {
		return nil, e.fail(err)
	}
	return ev, nil
}

// checkGrads refuses a batch with any bad gradient before anything else
// changes, and marks the batch's parameters as reported when it takes it.
func (e *Engine) checkGrads(params []int, grads []Tensor, stream Stream) (err error) {
	reported := e.pl.reported
	marked := 0
	defer func() {
		if err != nil {
			for _, p := range params[:marked] {
				reported[p] = false
			}
		}
	}()
	if len(params) != len(grads) {
		return errorf(ErrParam, "GradsReady: %d parameters and %d gradients; pass one gradient per parameter", len(params), len(grads))
	}
	if stream == nil {
		return errorf(ErrStream, "GradReady: nil stream; pass the stream that wrote the gradient")
	}
	if err := e.dev.checkStream(stream); err != nil {
		return err
	}
	for i, param := range params {
		if param < 0 || param >= len(e.params) {
			return errorf(ErrParam, "GradReady: parameter %d; registered parameters are 0..%d", param, len(e.params)-1)
		}
		p, grad := e.params[param], grads[i]
		if err := grad.check(fmt.Sprintf("GradReady(%d %q): the gradient", param, p.Name)); err != nil {
			return err
		}
		if grad.dtype != p.DType {
			return errorf(ErrDType, "GradReady(%d %q): gradient is %v, parameter is %v; pass the gradient in the parameter's dtype", param, p.Name, grad.dtype, p.DType)
		}
		if grad.count != p.Count {
			return errorf(ErrGradSize, "GradReady(%d %q): gradient has %d elements, parameter has %d; pass the whole gradient", param, p.Name, grad.count, p.Count)
		}
		if p.Frozen {
			return errorf(ErrParam, "GradReady(%d %q): the parameter is frozen; report gradients of trained parameters only", param, p.Name)
		}
		if grad.count > 0 && grad.ptr == 0 {
			return errorf(ErrGradSize, "GradReady(%d %q): gradient has no memory", param, p.Name)
		}
		if reported[param] {
			return errorf(ErrDuplicateGrad, "GradReady(%d %q) twice in one backward; call EndBackward between backwards, or sum the gradient before reporting it", param, p.Name)
		}
		reported[param] = true // taken back above if a later gradient is refused
		marked = i + 1
	}
	return nil
}

// EndBackward closes a backward. Members that did not report count as
// zero. Streamed buckets are all reduced now; local buckets only when the
// backward was flagged as the boundary, and otherwise at Step.
func (e *Engine) EndBackward() error {
	if err := e.usable("EndBackward"); err != nil {
		return err
	}
	s := e.lastStream
	if s == nil {
		s = e.reduceStream
	}
	if e.co.flushNext {
		e.co.resident = e.pl.mem.cur
		// The backward after NoSync reduces on every rank, also on one
		// that reported nothing in it: the collectives never depend on data.
		e.boundary = true
	}
	e.pl.owesFlush()
	if err := e.pl.issueReady(s, true, e.boundary); err != nil {
		return e.fail(err)
	}
	e.pl.endBackward()
	if e.off != nil {
		if err := e.off.endBackward(); err != nil {
			return e.fail(err)
		}
	}
	if e.boundary {
		e.afterFlush()
	}
	e.inBackward = false
	e.boundary = false
	e.lastStream = nil
	e.backwards++
	return nil
}

// DiscardGrads drops every gradient taken since the last Step, as PyTorch's
// zero_grad: the backward under way, if any, ends without reducing what it
// held; the window's local sums and the shard's partial sums are dropped;
// the next backward starts a new window (a coalesced window or NoSync in
// progress stays open; a pending NoSync flush is dropped with its sums).
// It is the way back after a refused call in the middle of a backward or
// a window. Every rank must call it at the same point: the reductions
// issued before it have run, and no rank may have issued one that another
// has not. Until the next Step the reduced gradient cannot be read.
func (e *Engine) DiscardGrads() error {
	if err := e.usable("DiscardGrads"); err != nil {
		return err
	}
	if err := e.pl.discard(); err != nil {
		return e.fail(err)
	}
	if e.off != nil {
		e.off.discard()
	}
	e.events.recycle() // every producer event was synced
	e.inBackward, e.boundary, e.lastStream = false, false, nil
	e.backwards = 0
	clear(e.usedWindow)
	e.afterFlush()
	e.discarded = true
	return nil
}

// Step ends the accumulation window. Its first collective checks that
// every rank took the same number of backwards G (and G = GradAccumSteps
// where that is set); then it runs the reductions still pending (local
// buckets without a boundary), waits for all of them, and records the
// step's stats. The reduced shard is readable until the next backward. A
// Step refused for the window keeps the window: no gradient is lost.
func (e *Engine) Step() error {
	if err := e.usable("Step"); err != nil {
		return err
	}
	if e.inBackward {
		return errorf(ErrProtocol, "Step inside a backward; call EndBackward first")
	}
	if e.co.active || e.co.noSync {
		return errorf(ErrProtocol, "Step inside a Coalesce window or NoSync; end it first")
	}
	g, used, err := e.agreeOnWindow()
	if err != nil {
		return err
	}
	if e.pl.unflushed {
		if e.co.flushNext {
			e.co.resident = e.pl.mem.cur
		}
		if err := e.pl.flushLocal(e.reduceStream); err != nil {
			return e.fail(err)
		}
	}
	e.afterFlush()
	if err := e.pl.sync(); err != nil {
		return e.fail(err)
	}
	overflow := []float32{0}
	sd, ss := e.shardSide(e.copyStream)
	if err := sd.copy(ss, Float32s(overflow), e.pl.flag); err != nil {
		return e.fail(err)
	}
	if err := sd.zero(ss, e.pl.flag); err != nil {
		return e.fail(err)
	}
	if err := ss.Sync(); err != nil {
		return e.fail(err)
	}
	if e.ps != nil {
		if err := e.endParamWindow(); err != nil {
			return e.fail(err)
		}
	}
	readScale := float32(1)
	if e.cfg.Grads.Reduction == Mean {
		readScale = float32(1 / float64(g))
	}
	res := stepResult{scale: 1}
	if e.opt != nil {
		if res, err = e.optimizerStep(readScale, used, overflow[0]); err != nil {
			return e.fail(err)
		}
	}
	reduce, err := e.pl.reduceTimes.take()
	if err != nil {
		return e.fail(err)
	}
	pooled := e.pl.stagingPool.bytes + e.pl.localPool.bytes + e.pl.windowPool.bytes
	e.stats = Stats{
		Step:                e.stepIndex,
		Backwards:           g,
		Collectives:         e.pl.sent,
		ReduceTime:          reduce,
		StagingBuffers:      e.pl.stagingPool.held,
		PeakGradBytes:       e.pl.mem.peak,
		ResidentGradBytes:   e.pl.mem.cur,
		PooledGradBytes:     pooled,
		Overflow:            overflow[0] != 0,
		Skipped:             res.skipped,
		GradNorm:            res.norm,
		LossScale:           res.scale,
		WindowResidentBytes: e.co.resident,
		OptimizerTime:       res.optimizeTime,
		ParamGatherTime:     res.gatherTime,
	}
	if e.opt != nil {
		e.stats.OptimizerBytes = e.opt.mem.cur
	}
	if err := e.offloadStats(&e.stats); err != nil {
		return e.fail(err)
	}
	if st := e.ps; st != nil {
		e.stats.ParamShardBytes, e.stats.PeakParamBytes, e.stats.GatherBuffers = int64(st.shard.Bytes()), st.mem.peak, st.pool.held
		e.stats.PrefetchHits, e.stats.PrefetchMisses, e.stats.PrefetchWasted = st.hits, st.misses, st.wasted
		st.hits, st.misses, st.wasted = 0, 0, 0
		st.mem.peak = st.mem.cur
		if e.stats.ParamGatherTime, err = st.times.take(); err != nil {
			return e.fail(err)
		}
	}
	e.co.resident = 0
	e.pl.sent = CommCounters{}
	e.pl.mem.peak = e.pl.mem.cur
	e.stepIndex++
	e.discarded = false
	e.backwards = 0
	e.readScale = readScale
	clear(e.usedWindow)
	e.pl.newWindow()
	e.events.recycle() // every producer event was waited on by a synced reduction
	if e.ps != nil {
		// the next window's first buckets, from the updated shard
		ev, err := e.reduceStream.Record()
		if err == nil {
			err = e.gatherStream.Wait(ev)
		}
		if err == nil {
			err = e.prefetch()
		}
		if err != nil {
			return e.fail(err)
		}
	}
	return nil
}

// windowSlots places the parts of Step's first all-reduce after (G, −G);
// −1 where absent.
type windowSlots struct {
	refs   int // stage 3: parameter references still gathered
	digest int // the optimizer groups' digest, then its negation
	used   int // per parameter: reported on this rank in the window
}

// digestWords is how many 16-bit pieces of a digest the all-reduce
// carries: each an integer that fp32 holds exactly.
const digestWords = 3

// agreeOnWindow max-all-reduces (G, −G) so every rank learns the largest
// and smallest number of backwards taken since the last Step, and every
// rank refuses the same windows: none taken, ranks that differ, a G other
// than Grads.AccumSteps, parameters still gathered, or optimizer groups
// that differ after SetGroup.
func (e *Engine) agreeOnWindow() (int, []bool, error) {
	n := float32(e.backwards)
	buf := make([]float32, e.window.count)
	buf[0], buf[1] = n, -n
	if e.slots.refs >= 0 {
		buf[e.slots.refs] = float32(e.stillGathered())
	}
	if e.slots.digest >= 0 {
		for i := range digestWords {
			w := float32(e.opt.groupsDigest >> (16 * i) & 0xffff)
			buf[e.slots.digest+i], buf[e.slots.digest+digestWords+i] = w, -w
		}
	}
	for p, used := range e.usedWindow {
		if used && e.slots.used >= 0 {
			buf[e.slots.used+p] = 1
		}
	}
	s := e.reduceStream
	if err := e.dev.copy(s, e.window, Float32s(buf)); err != nil {
		return 0, nil, e.fail(err)
	}
	if err := e.comm.AllReduce(s, e.window, OpMax); err != nil {
		return 0, nil, e.fail(err)
	}
	e.pl.sent.add(KindAllReduce, e.window.Bytes(), e.world)
	if err := e.dev.copy(s, Float32s(buf), e.window); err != nil {
		return 0, nil, e.fail(err)
	}
	if err := s.Sync(); err != nil {
		if errors.Is(err, ErrMismatch) || errors.Is(err, ErrTimeout) {
			err = fmt.Errorf("Step: the ranks' collectives diverged before its window check: at stages 2 and 3 ranks that took different numbers of backwards since the last Step (this rank took %d) issued different reductions; every rank must take the same backwards, call windows, gathers and reads at the same points, and at stage 3 hand over the same parameters in a backward that gathers: %w", e.backwards, err)
		}
		return 0, nil, e.fail(err)
	}
	groupsDiffer := false
	for i := 0; e.slots.digest >= 0 && i < digestWords; i++ {
		groupsDiffer = groupsDiffer || buf[e.slots.digest+i] != -buf[e.slots.digest+digestWords+i]
	}
	most, least := int(buf[0]), int(-buf[1])
	switch {
	case groupsDiffer: // every rank sees it: every rank takes part in naming it
		records, err := allGatherBytes(e.dev, e.comm, s, encodeRecord(groupsRecord(e.opt.groups), ""))
		if err != nil {
			return 0, nil, e.fail(err)
		}
		return 0, nil, settingsError(records, "Step after SetGroup")
	case e.slots.refs >= 0 && buf[e.slots.refs] > 0:
		return 0, nil, errorf(ErrProtocol, "Step with parameters still gathered (%d references on some rank, %d here); Release what Gather returned first", int(buf[e.slots.refs]), e.stillGathered())
	case most != least:
		return 0, nil, errorf(ErrMismatch, "Step: ranks took between %d and %d backwards since the last Step (this rank %d); every rank must take the same number", least, most, e.backwards)
	case most == 0:
		return 0, nil, errorf(ErrProtocol, "Step with no backward since the last Step; report gradients and call EndBackward first")
	case e.cfg.Grads.AccumSteps > 0 && most != e.cfg.Grads.AccumSteps:
		return 0, nil, errorf(ErrProtocol, "Step after %d backwards with Grads.AccumSteps %d; take %d backwards per step, or leave AccumSteps at 0 to divide by the backwards taken", most, e.cfg.Grads.AccumSteps, e.cfg.Grads.AccumSteps)
	}
	used := make([]bool, len(e.params))
	for p := range used {
		used[p] = e.slots.used < 0 || buf[e.slots.used+p] != 0
	}
	return most, used, nil
}

// Settings returns the engine's settings record: every setting of its
// resolved Config (the optimizer groups as SetGroup left them), the world
// size and the parameters, each with its class. New compared all but the
// rank-local ones across ranks.
func (e *Engine) Settings() []Setting {
	cfg := e.cfg
	if e.opt != nil {
		cfg.Optimizer.Groups = e.opt.groups
	}
	return settingsRecord(cfg, e.params, e.world)
}

// Stats describes one step.
type Stats struct {
	Step int // the step's index, from 0
	// Backwards is the number of backwards G in the window.
	Backwards int
	// Collectives is what the engine moved for the step on this rank, by
	// kind: the reductions and Step's window check. A caller's own
	// collectives on the same Comm are not counted.
	Collectives CommCounters
	// ReduceTime is the time the reductions ran (reduce-scatter and
	// accumulate; with Offload the reduce-scatter only, the sum runs on the
	// host), summed over buckets.
	ReduceTime time.Duration
	// StagingBuffers is the size of the bucket buffer pool; it grows past
	// Config.StagingBuffers only when buckets complete out of order.
	StagingBuffers int
	// PeakGradBytes and ResidentGradBytes count the gradient memory the
	// engine holds on the device: the fp32 shard (on the host with
	// Offload), the staging buffers and local accumulators, in use or
	// pooled. The peak is over the window; it starts
	// again from the resident bytes at Step.
	PeakGradBytes     int64
	ResidentGradBytes int64 // see PeakGradBytes
	// WindowResidentBytes is the gradient memory held at the end of a
	// coalesced window's (or NoSync's) last backward, before its flush: the
	// shard, the local sums and the staging buffers (0 without a window).
	WindowResidentBytes int64
	// PooledGradBytes is the part of ResidentGradBytes that the pools hold
	// idle at the end of the step, kept for the next window; TrimPools frees
	// what is beyond the configured staging buffers.
	PooledGradBytes int64
	// Overflow is set when a reduced gradient on this rank was inf or NaN.
	Overflow bool
	// With an optimizer: Skipped is set when every rank skipped the step
	// (an inf or NaN gradient on any rank, or a non-finite norm), leaving
	// master weights, optimizer state and parameters as they were;
	// GradNorm is the global norm of the gradient the step used (before
	// clipping, after unscaling; NaN or inf when it skipped for it);
	// LossScale is the scale the window's gradients carried.
	Skipped   bool
	GradNorm  float64 // see Skipped
	LossScale float64 // see Skipped
	// OptimizerBytes is the optimizer's device memory on this rank: the
	// fp32 master shard and the moments (on the host with Offload), the
	// model-dtype shard and the buffers the new parameters are gathered in.
	OptimizerBytes int64
	// OptimizerTime is the device time of the fused optimizer pass (with
	// Offload, the host's), and ParamGatherTime that of the all-gather of
	// the new parameters into their memory (with Offload, from the end of
	// the optimizer's launches: the wait for each bucket's copy to the
	// device included; zero when the step skipped); at stage 3, that of the
	// window's gathers.
	OptimizerTime   time.Duration
	ParamGatherTime time.Duration // see OptimizerTime

	// Stage 3 with parameter shards: the parameter memory (the shard, and
	// the peak of shard plus gather buffers over the window; ParamMemory
	// tells it at any moment), the gather buffers allocated, and the
	// window's buckets asked for that a prefetch had gathered (hits), that
	// were gathered on demand while a last order existed (misses), and that
	// were prefetched but never asked for (wasted).
	ParamShardBytes int64
	PeakParamBytes  int64 // see ParamShardBytes
	GatherBuffers   int   // see ParamShardBytes
	PrefetchHits    int   // see ParamShardBytes
	PrefetchMisses  int   // see ParamShardBytes
	PrefetchWasted  int   // see ParamShardBytes

	// With Offload: HostBytes is the engine's host memory (the fp32
	// gradient shard, the master weights, the optimizer state, the
	// model-dtype copy of the new parameters and the buffers reduced shards
	// land in), HostPinnedBytes the part of it that is page-locked (all of
	// it on a GPU; on the CPU device, what mlock accepted), HostGradBytes
	// the part that holds gradients (the shard and the landing buffers,
	// whatever the number of backwards), DeviceBytesSaved the device memory
	// the same engine holds without Offload and this one does not (the
	// gradient shard, the master weights and the optimizer state).
	HostBytes        int64
	HostPinnedBytes  int64 // see HostBytes
	HostGradBytes    int64 // see HostBytes
	DeviceBytesSaved int64 // see HostBytes
	// With Offload: GradCopyTime is the copy stream's time for the window's
	// reduced shards to the host, GradCopyExposed the part of it that ran
	// after the window's last backward ended (the rest overlapped with
	// backward), and ParamCopyTime that of the step's new parameters to the
	// device.
	GradCopyTime    time.Duration
	GradCopyExposed time.Duration // see GradCopyTime
	ParamCopyTime   time.Duration // see GradCopyTime
}

// Stats returns the stats of the last Step.
func (e *Engine) Stats() Stats { return e.stats }

// DeviceMemory reads every GPU's memory from NVML now (nil on the host or
// without NVML). It is not part of Stats: a step never queries NVML.
func (e *Engine) DeviceMemory() []GPUMemory { return e.dev.memoryStats() }

// readable refuses reads of the reduced gradient outside the span from a
// Step to the next backward, where the shard holds partial sums.
func (e *Engine) readable(op string) error {
	if err := e.usable(op); err != nil {
		return err
	}
	if e.inBackward || e.backwards > 0 {
		return errorf(ErrProtocol, "%s while a backward of the next window is under way; the shard holds partial sums until Step", op)
	}
	if e.stepIndex == 0 {
		return errorf(ErrProtocol, "%s before the first Step; there is no reduced gradient yet", op)
	}
	if e.discarded {
		return errorf(ErrProtocol, "%s after DiscardGrads; the shard holds no reduced gradient until the next Step", op)
	}
	if err := e.pl.sync(); err != nil {
		return e.fail(err)
	}
	return nil
}

// GradShard returns a copy of this rank's reduced fp32 gradient shard: for
// every bucket in plan order, its Shard elements starting at ShardOffset.
// The mean's 1/G is applied by the copy.
func (e *Engine) GradShard() ([]float32, error) {
	if err := e.readable("GradShard"); err != nil {
		return nil, err
	}
	out := make([]float32, e.plan.ShardElems)
	d, s := e.shardSide(e.copyStream)
	if err := e.copyScaled(d, s, Float32s(out), e.pl.shard, e.readScale); err != nil {
		return nil, err
	}
	return out, nil
}

// copyScaled copies between host memory and d's, times scale, on s, and
// waits for it.
func (e *Engine) copyScaled(d Device, s Stream, dst, src Tensor, scale float32) error {
	if err := d.copyScaled(s, dst, src, scale); err != nil {
		return e.fail(err)
	}
	if err := s.Sync(); err != nil {
		return e.fail(err)
	}
	return nil
}

// FullGrads all-gathers the shards and returns the full reduced gradient
// of every parameter, in registration order. It is a collective: every
// rank calls it. Its traffic is not counted in the step's stats.
func (e *Engine) FullGrads() ([][]float32, error) {
	if err := e.readable("FullGrads"); err != nil {
		return nil, err
	}
	all, err := e.dev.Alloc(e.plan.ShardElems*e.world, FP32)
	if err != nil {
		return nil, err
	}
	defer e.dev.Free(all)
	send := e.pl.shard
	if e.off != nil { // the collective needs the shard in device memory
		send = all.slice(e.rank*e.plan.ShardElems, e.plan.ShardElems)
		copied, err := e.off.transfer(send, e.pl.shard, nil, false) // the shard is synced: readable
		if err == nil {
			err = e.gatherStream.Wait(copied)
		}
		if err != nil {
			return nil, e.fail(err)
		}
	}
	if err := e.comm.AllGather(e.gatherStream, send, all); err != nil {
		return nil, e.fail(err)
	}
	gathered, err := e.gatherStream.Record()
	if err != nil {
		return nil, e.fail(err)
	}
	if err := e.copyStream.Wait(gathered); err != nil {
		return nil, e.fail(err)
	}
	host := make([]float32, all.count)
	if err := e.copyScaled(e.dev, e.copyStream, Float32s(host), all, e.readScale); err != nil {
		return nil, err
	}
	out := make([][]float32, len(e.params))
	for p, q := range e.params {
		out[p] = make([]float32, q.Count)
		for r := range e.world {
			rg := e.plan.shardRange(p, r)
			at := r*e.plan.ShardElems + rg.ShardOffset
			copy(out[p][rg.ParamOffset:], host[at:at+rg.Count])
		}
	}
	return out, nil
}

// TrimPools frees the pooled buffers that are idle: staging buffers beyond
// Config.StagingBuffers (the pool grows when buckets complete out of order)
// and ZeRO-1's local accumulators between windows. The stats' resident
// bytes drop by as much; the next window allocates what it needs again.
func (e *Engine) TrimPools() error {
	if err := e.usable("TrimPools"); err != nil {
		return err
	}
	if err := e.pl.trim(); err != nil {
		return e.fail(err)
	}
	return nil
}

// Close waits for the work the engine enqueued (pending reductions, and
// reads of gradients into a bucket that never filled) and frees the
// engine's memory. It does not close the communicator. Closing twice does
// nothing.
func (e *Engine) Close() error {
	if e.closed {
		return nil
	}
	e.closed = true
	e.drain()
	var errs []error
	if e.pl != nil {
		errs = append(errs, e.pl.close())
	}
	if e.opt != nil {
		errs = append(errs, e.opt.close(e.dev))
	}
	if e.ps != nil {
		errs = append(errs, e.ps.close(e.dev))
	}
	if e.off != nil {
		errs = append(errs, e.off.close())
	}
	for _, s := range []Stream{e.reduceStream, e.gatherStream, e.copyStream} {
		if s != nil {
			errs = append(errs, s.Close())
		}
	}
	if e.window.ptr != 0 {
		errs = append(errs, e.dev.Free(e.window))
	}
	return errors.Join(errs...)
}
