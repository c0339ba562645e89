package zero

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// Engine is one rank's ZeRO engine. Its methods are called from the rank's
// own goroutine; the engine is not safe for concurrent use.
//
// The engine is the hub: it checks the caller's calls and orchestrates its
// components, each of which owns its state: the pipeline (bucket.go), its
// sink (the device's, or offload's), the window (coalesce.go), the
// optimizer (optim.go), stage 3's parameters (params.go) and offload
// (offload.go).
type Engine struct {
	cfg    Config
	comm   Comm
	dev    Device
	plan   *Plan
	params []Param
	rank   int
	world  int

	// The engine's own streams: reductions (under Overlap) and Step's
	// collectives; gathers (stage 3, FullGrads); copies to the host.
	reduceStream, gatherStream, copyStream Stream
	streams                                []Stream // every stream drain waits for

	pl        *pipeline
	win       window
	opt       *optState   // nil without Optimizer.Groups: Step only reduces
	off       *offload    // nil without Offload.Optimizer
	ps        *paramState // stage 3 with parameter memory: the parameter shards
	host      *hostMemory // the page-locked memory of offload and of an offloaded parameter shard; nil without offload
	reporters []statsReporter

	events eventPool    // the window's producer events, untimed
	ends   *backwardEnd // when the window's last backward ended, for the exposed times
	files  ckptFS       // the file layer of checkpoints; nil: the operating system's
	one    struct {     // GradReady's batch of one
		param [1]int
		grad  [1]Tensor
	}
	check      *stepCheck // Step's first collective
	usedWindow []bool     // per parameter: reported in this window, on this rank

	// backward state
	inBackward bool
	boundary   bool
	lastStream Stream

	// window state
	backwards int // backwards since the last Step
	stepIndex int
	readScale float32 // the mean's 1/G, applied by whatever reads the shard
	discarded bool    // DiscardGrads dropped the shard's sums: nothing to read until Step
	// endedBy names the DiscardGrads (or failed Coalesce or NoSync) that
	// ended the backward, until a gradient, a window or Step comes: an
	// EndBackward in between would count an empty backward and shrink the
	// next mean.
	endedBy     string
	closedByEnd bool // and it closed a window: a window's end is refused too
	stats       Stats
	failed      error
	closed      bool
	// aborted holds Abort's reason; it is set from any goroutine.
	aborted atomic.Pointer[error]
	// callerStreams are the streams the caller handed over since the last
	// Step: a failure that came from one of them is the framework's.
	callerStreams map[Stream]struct{}
}

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
	e := &Engine{cfg: cfg, comm: comm, dev: comm.Device(), params: append([]Param(nil), params...), rank: comm.Rank(), world: comm.Size(),
		callerStreams: map[Stream]struct{}{}}
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
		e.streams = append(e.streams, *s)
	}
	var err error
	if e.ends, err = newBackwardEnd(e.dev); err != nil {
		return err
	}
	e.streams = append(e.streams, e.ends.stream())
	if err := checkSettings(e.dev, e.comm, e.reduceStream, settingsRecord(e.cfg, e.params, e.world)); err != nil {
		return err
	}
	// Where the fp32 shard and the optimizer's state live: the device, or
	// with offload the host, which is then both the pipeline's sink and the
	// optimizer's home.
	// The sink keeps the sums of squares of its shard for the optimizer's
	// norm.
	withNorm := len(e.cfg.Optimizer.Groups) > 0
	stage3 := e.cfg.Stage == 3 && hasParamMemory(e.params)
	paramsOnHost := stage3 && e.cfg.Offload.Params
	if e.cfg.Offload.Optimizer || paramsOnHost {
		if e.host, err = newHostMemory(e.dev); err != nil {
			return err
		}
		e.reporters = append(e.reporters, e.host)
	}
	var sk sink
	var home optimizerHome
	if e.cfg.Offload.Optimizer {
		off, err := newOffload(offloadSpec{dev: e.dev, mem: e.host, plan: e.plan, copy: e.copyStream, commDType: e.cfg.Precision.CommDType,
			shardDType: e.cfg.Precision.ShardDType, keep: e.cfg.StagingBuffers, withNorm: withNorm, modelOnHost: paramsOnHost, ends: e.ends})
		if err != nil {
			if off != nil { // no pipeline owns its shard yet
				err = errors.Join(err, off.close(), off.shutdown())
			}
			return err
		}
		e.off = off
		e.streams = append(e.streams, e.off.hostStream())
		sk, home = e.off, e.off
	} else {
		ds, err := newDeviceSink(e.dev, e.plan, e.cfg.Precision.ShardDType, withNorm)
		if err != nil {
			return errors.Join(err, ds.close())
		}
		sk = ds
	}
	modes := stageBucketModes(e.cfg.Stage, len(e.plan.Buckets))
	// The 1/W of the mean goes into the reduction (ncclAvg) where dividing by
	// W is exact, a power of two: the same bits as a sum scaled afterwards,
	// and no overflow of a half-precision sum on the wire. Elsewhere it goes
	// into the accumulate's post-scale. The 1/G is known only at Step.
	f := e.cfg.Grads.PredivideFactor
	reduceOp, postscale := OpSum, float32(f)
	if e.cfg.Grads.Reduction == Mean {
		postscale = float32(f / float64(e.world))
		if e.world&(e.world-1) == 0 {
			reduceOp, postscale = OpAvg, float32(f)
		}
	}
	spec := pipelineSpec{rank: e.rank, world: e.world, commDType: e.cfg.Precision.CommDType, overlap: e.cfg.Overlap,
		staging: e.cfg.StagingBuffers, modes: modes, windowDType: e.cfg.Window.DType,
		prescale: float32(1 / f), reduceOp: reduceOp, postscale: postscale}
	if e.pl, err = newPipeline(spec, e.plan, e.dev, e.comm, e.reduceStream, sk, e.ends); err != nil {
		return err
	}
	e.win = newWindow(e.pl, e.plan, e.cfg.Window)
	e.usedWindow = make([]bool, len(e.params))
	if e.check, err = newStepCheck(e.dev, e.comm, e.reduceStream, len(e.params), stage3, len(e.cfg.Optimizer.Groups) > 0); err != nil {
		return err
	}
	e.reporters = append(e.reporters, e.check, e.pl, &e.win)
	ld := loadSpec{dev: e.dev, comm: e.comm, s: e.reduceStream, plan: e.plan, params: e.params, broadcast: !e.cfg.Params.NoBroadcast}
	var shared *Tensor
	if stage3 {
		var host *hostMemory // the shard in page-locked memory
		if paramsOnHost {
			host = e.host
		}
		if e.ps, err = newParamState(ld, e.cfg.Params, e.gatherStream, host); err != nil {
			return err
		}
		shared = e.ps.sharedShard()
	}
	if len(e.cfg.Optimizer.Groups) > 0 {
		load := func(pool *bufferPool, into Tensor) error { return loadShard(ld, pool, into) }
		if e.opt, err = newOptimizer(optimizerSpec{cfg: e.cfg, dev: e.dev, comm: e.comm, plan: e.plan, params: e.params,
			s: e.reduceStream, home: home, shared: shared, load: load}); err != nil {
			return err
		}
		e.reporters = append(e.reporters, e.opt)
	}
	if e.ps != nil {
		e.reporters = append(e.reporters, e.ps) // at stage 3 its gather time is the window's
	}
	if e.off != nil {
		e.reporters = append(e.reporters, e.off)
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
	if reason := e.aborted.Load(); reason != nil {
		return fmt.Errorf("%w: %s after Abort: %w", ErrAborted, op, *reason)
	}
	if e.closed {
		return errorf(ErrClosed, "%s after Close", op)
	}
	if e.failed != nil {
		return fmt.Errorf("%w: %s: the engine failed earlier and cannot go on (Close it): %w", ErrCollective, op, e.failed)
	}
	return nil
}

// fail makes the engine refuse every later call. It waits for the engine's
// own streams, so no work of the failed call still writes the caller's
// memory once it returns, and returns err as a fatal error: one that
// errors.Is finds as ErrCollective and as its cause.
func (e *Engine) fail(err error) error {
	// Failed already: the error is the engine's failure. A Comm's own error
	// may wrap ErrCollective too (a caller's Comm, the fuzzer's faults):
	// that is a cause, and the engine fails on it.
	var already *failure
	if errors.As(err, &already) && e.failed != nil {
		return err
	}
	var kinds []error
	if reason := e.aborted.Load(); reason != nil && !errors.Is(err, ErrAborted) {
		kinds = append(kinds, ErrAborted)
	}
	for s := range e.callerStreams {
		if hs, ok := s.(*HostStream); ok && hs.failedWith(err) && !errors.Is(err, ErrStream) {
			kinds = append(kinds, ErrStream) // the framework's stream failed, not the engine
			break
		}
	}
	f := &failure{cause: err, kinds: kinds}
	if e.failed == nil {
		e.failed = f
		e.drain()
	}
	return f
}

// ownFailure tells a caller's stream that failed by itself (a refusal:
// err) from one that carries a reduction of the engine (without Overlap)
// or failed waiting on the engine's own failed work: the engine's failure
// (fatal).
func (e *Engine) ownFailure(err error, caller Stream) error {
	if e.pl.reducesOn(caller) { // a reduction it carries is lost with it
		if hs, ok := caller.(*HostStream); ok && hs.failure() != nil {
			err = hs.failure() // what failed, not the advice for a stream of the caller's
		}
		return e.fail(divergence("a reduction on the caller's stream", e.backwards, err))
	}
	for _, s := range e.streams {
		if hs, ok := s.(*HostStream); ok {
			if own := hs.failure(); own != nil {
				return e.fail(divergence("the engine's reductions", e.backwards, own))
			}
		}
	}
	return err
}

// Abort makes every call of this engine that is blocked, and every later
// one but Close, return promptly with an error wrapping ErrAborted (and
// reason), and tells the other ranks through the communicator, so that
// their blocked and later collectives fail at once with ErrPeerFailed
// instead of waiting for the group's timeout. It is safe from any
// goroutine and returns at once. The in-process groups and NCCL carry the
// abort to every rank; a Comm of the caller's own is told through an
// Abort(error) method if it has one. Close the engine afterwards, from its
// own goroutine.
func (e *Engine) Abort(reason error) {
	if reason == nil {
		reason = errors.New("no reason given")
	}
	if e.aborted.CompareAndSwap(nil, &reason) {
		AbortComm(e.comm, fmt.Errorf("rank %d aborted: %w", e.rank, reason))
	}
}

// drain waits for the work on the engine's streams; their errors went to
// the call that enqueued it.
func (e *Engine) drain() {
	for _, s := range e.streams {
		s.Sync()
	}
}

// SetBoundary(true) before the last backward of a step lets its deferred
// reductions (ZeRO-1's deferred buckets) overlap with that backward. It lasts
// until EndBackward. Gradients still sum over every backward since the last
// Step: a boundary never drops earlier backwards.
//
// Call it between backwards, at the same point on every rank: whether the
// deferred buckets are reduced during a backward must be the same on every
// rank. Inside a backward (after this rank's first gradient of it) it has
// no effect on that backward, whose deferred buckets the next flush (Step)
// reduces; inside a coalesced window or NoSync it has none either: the
// window's end is its boundary.
func (e *Engine) SetBoundary(b bool) {
	if e.inBackward || e.win.open() {
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
//
// At stage 3 with parameter memory, a gradient of a parameter that no
// Gather of the caller named since the last Step is refused (ErrParam):
// its forward cannot have read the current value, which lives only in the
// shards. The engine's prefetch does not count; one Gather covers every
// backward until Step.
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
	if !e.inBackward {
		if e.win.startsFlush() {
			e.boundary = true // the backward after NoSync reduces as it goes
		}
		if !e.win.open() {
			if err := e.pl.releaseWindowSums(); err != nil {
				return nil, e.fail(err)
			}
		}
	}
	e.inBackward = true
	e.endedBy = ""
	e.lastStream = stream
	e.callerStreams[stream] = struct{}{}
	taken, err := e.pl.takeBatch(params, grads, stream)
	if err != nil {
		return nil, e.fail(err)
	}
	if !taken {
		return nil, nil // only empty parameters: nothing to read
	}
	ev, err := e.events.record(stream)
	if err != nil {
		return nil, e.fail(err)
	}
	e.pl.producedBatch(params, stream, ev)
	e.ends.produced(stream, ev)
	for _, p := range params {
		e.usedWindow[p] = true
	}
	if err := e.pl.issueReady(stream, false, e.boundary, e.lastBackward()); err != nil {
		return nil, e.fail(divergence("GradReady", e.backwards, err))
	}
	return ev, nil
}

// checkGrads refuses a batch with any bad gradient before anything else
// changes, and marks the batch's parameters as reported when it takes it.
func (e *Engine) checkGrads(params []int, grads []Tensor, stream Stream) error {
	if len(params) != len(grads) {
		return errorf(ErrParam, "GradsReady: %d parameters and %d gradients; pass one gradient per parameter", len(params), len(grads))
	}
	if stream == nil {
		return errorf(ErrStream, "GradReady: nil stream; pass the stream that wrote the gradient")
	}
	if err := e.dev.checkStream(stream); err != nil {
		return e.ownFailure(err, stream)
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
		if e.ps != nil && e.ps.unasked(param) {
			return errorf(ErrParam, "GradReady(%d %q) at stage 3 with no Gather of it since the last Step: "+
				"Param.Data is read at New only; read the parameter in the forward through Gather's view, and Release it after", param, p.Name)
		}
	}
	return e.pl.markReported(params, func(p int) string { return e.params[p].Name })
}

// lastBackward says whether the backward under way is known to be the
// step's last: flagged as the boundary, or the Grads.AccumSteps-th. Its
// landings then sum the norm's squares as they store (a hint: a later
// landing into a bucket makes Step read that bucket again).
func (e *Engine) lastBackward() bool {
	n := e.cfg.Grads.AccumSteps
	return e.boundary || (n > 0 && e.backwards+1 == n)
}

// EndBackward closes a backward. Members that did not report count as
// zero. Streamed buckets are all reduced now; deferred buckets only when the
// backward was flagged as the boundary, and otherwise at Step.
func (e *Engine) EndBackward() error {
	if err := e.usable("EndBackward"); err != nil {
		return err
	}
	if e.endedBy != "" {
		return errorf(ErrProtocol, "EndBackward right after %s, which ended the backward and dropped every gradient since the last Step: "+
			"this EndBackward would count an empty backward and shrink the next mean; leave it out, and take the step's backwards again from the first", e.endedBy)
	}
	s := e.lastStream
	if s == nil {
		s = e.reduceStream
	}
	if e.win.flushing() {
		// The backward after NoSync reduces on every rank, also on one
		// that reported nothing in it: the collectives never depend on data.
		e.boundary = true
	}
	e.pl.owesFlush()
	if err := e.pl.issueReady(s, true, e.boundary, e.lastBackward()); err != nil {
		return e.fail(divergence("EndBackward", e.backwards, err))
	}
	e.pl.endBackward()
	if err := e.ends.mark(); err != nil {
		return e.fail(err)
	}
	if e.boundary {
		e.win.afterFlush()
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
	e.ends.restart()
	e.events.recycle() // every producer event was synced
	e.inBackward, e.boundary, e.lastStream = false, false, nil
	e.backwards = 0
	clear(e.usedWindow)
	e.win.afterFlush()
	e.discarded = true
	e.endedBy, e.closedByEnd = "DiscardGrads", false
	return nil
}

// Step ends the accumulation window. Its first collective checks that
// every rank took the same number of backwards G (and G = Grads.AccumSteps
// where that is set); then it runs the reductions still pending (local
// buckets without a boundary), waits for all of them, runs the optimizer
// and records the step's stats. The reduced shard is readable until the
// next backward. A Step refused by its first collective keeps the window.
func (e *Engine) Step() error {
	if err := e.usable("Step"); err != nil {
		return err
	}
	if e.inBackward {
		return errorf(ErrProtocol, "Step inside a backward; call EndBackward first")
	}
	if e.win.open() {
		return errorf(ErrProtocol, "Step inside a Coalesce window or NoSync; end it first")
	}
	gathered, digest, groups := 0, uint64(0), []Optimizer(nil)
	if e.ps != nil {
		gathered = e.ps.stillGathered()
	}
	if e.opt != nil {
		digest, groups = e.opt.digest(), e.opt.currentGroups()
	}
	g, used, err := e.check.agree(windowClaims{backwards: e.backwards, gathered: gathered, digest: digest, groups: groups,
		used: e.usedWindow, accumSteps: e.cfg.Grads.AccumSteps})
	if errors.Is(err, errCheckFailed) {
		return e.fail(err)
	}
	if err != nil {
		return err
	}
	if e.pl.owesFlushAtStep() {
		if err := e.pl.flushLocal(e.reduceStream); err != nil {
			return e.fail(err)
		}
	}
	e.win.afterFlush()
	if err := e.pl.sync(); err != nil {
		return e.fail(divergence("Step", g, err))
	}
	overflow, err := e.pl.takeOverflow(e.copyStream)
	if err != nil {
		return e.fail(err)
	}
	if e.ps != nil {
		if err := e.ps.endWindow(); err != nil {
			return e.fail(err)
		}
	}
	readScale := float32(1)
	if e.cfg.Grads.Reduction == Mean {
		readScale = float32(1 / float64(g))
	}
	if e.opt != nil {
		sumsq, err := e.pl.squares(e.reduceStream)
		if err != nil {
			return e.fail(err)
		}
		if _, err := e.opt.step(e.pl.gradShard(), sumsq, readScale, used, overflow); err != nil {
			return e.fail(err)
		}
	}
	st := Stats{Step: e.stepIndex, Backwards: g, Overflow: overflow != 0, LossScale: 1}
	if err := collectStats(&st, e.reporters); err != nil {
		return e.fail(err)
	}
	e.stats = st
	e.ends.restart()
	clear(e.callerStreams)
	e.stepIndex++
	e.discarded = false
	e.endedBy = ""
	e.backwards = 0
	e.readScale = readScale
	clear(e.usedWindow)
	e.pl.newWindow()
	e.events.recycle() // every producer event was waited on by a synced reduction
	if e.ps != nil {
		if err := e.ps.afterStep(); err != nil {
			return e.fail(err)
		}
	}
	return nil
}

// Notices are what New noticed of its Config without refusing it, one a
// line: today a schedule whose warmup outlasts its total steps (as
// DeepSpeed warns, and ReadDeepSpeed's notices say). Nil when nothing.
func (e *Engine) Notices() []string {
	return scheduleNotices(e.cfg.Optimizer.Schedule)
}

// Settings returns the engine's settings record: every setting of its
// resolved Config (the optimizer groups as SetGroup left them), the world
// size and the parameters, each with its class. New compared all but the
// rank-local ones across ranks.
func (e *Engine) Settings() []Setting {
	cfg := e.cfg
	if e.opt != nil {
		cfg.Optimizer.Groups = e.opt.currentGroups()
	}
	return settingsRecord(cfg, e.params, e.world)
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
	d, s := e.pl.shardSide(e.copyStream)
	if err := e.copyScaled(d, s, Float32s(out), e.pl.gradShard(), e.readScale); err != nil {
		return nil, err
	}
	return out, nil
}

// copyScaled copies between host fp32 memory and d's (fp32, or the
// shard's 16-bit dtype, through an fp32 copy on d), times scale, on s, and
// waits for it.
func (e *Engine) copyScaled(d Device, s Stream, dst, src Tensor, scale float32) error {
	wide := func(t Tensor) (Tensor, error) { return d.Alloc(t.count, FP32) }
	var err error
	switch {
	case src.dtype != FP32: // d's 16-bit memory to the host
		var tmp Tensor
		if tmp, err = wide(src); err == nil {
			err = d.cast(s, tmp, src, 1)
			if err == nil {
				err = d.copyScaled(s, dst, tmp, scale)
			}
			err = errors.Join(err, s.Sync())
			freeSynced(d, tmp, err == nil, s)
		}
	case dst.dtype != FP32: // the host into d's 16-bit memory
		var tmp Tensor
		if tmp, err = wide(dst); err == nil {
			err = d.copyScaled(s, tmp, src, scale)
			if err == nil {
				err = d.cast(s, dst, tmp, 1)
			}
			err = errors.Join(err, s.Sync())
			freeSynced(d, tmp, err == nil, s)
		}
	default:
		if err = d.copyScaled(s, dst, src, scale); err == nil {
			err = s.Sync()
		}
	}
	if err != nil {
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
	all, err := e.dev.Alloc(e.plan.ShardElems*e.world, e.pl.gradShard().dtype)
	if err != nil {
		return nil, err
	}
	defer freeAfter(e.dev, all, e.gatherStream, e.copyStream)
	// the collective needs the shard in device memory
	send, err := e.pl.shardOnDevice(e.gatherStream, all.slice(e.rank*e.plan.ShardElems, e.plan.ShardElems))
	if err != nil {
		return nil, e.fail(err)
	}
	if err := e.comm.AllGather(e.gatherStream, send, all); err != nil {
		return nil, e.fail(err)
	}
	gathered, err := record(e.gatherStream)
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

// FullParams returns the current value of every parameter with memory, in
// fp32, in registration order (nil for a parameter without memory): at
// stages 1 and 2 read from Param.Data, which each Step updates; at stage 3
// all-gathered bucket by bucket from the parameter shards, which is where
// the current values live (Param.Data is read at New only). At stage 3 it
// is a collective: every rank calls it. Its traffic is not counted in the
// step's stats.
func (e *Engine) FullParams() ([][]float32, error) {
	if err := e.usable("FullParams"); err != nil {
		return nil, err
	}
	if !hasParamMemory(e.params) {
		return nil, errorf(ErrProtocol, "FullParams: the parameters were registered without memory; give Param.Data or Param.Init")
	}
	out, err := readParams(e.dev, e.gatherStream, e.reduceStream, e.plan, e.params, e.ps)
	if err != nil {
		return nil, e.fail(err)
	}
	return out, nil
}

// GradView returns parameter param's part of this rank's reduced fp32
// gradient shard. Read gives the same values as GradShard and FullGrads
// (the mean's 1/G applied); both Read and Write are refused while a
// backward of the next window is under way.
func (e *Engine) GradView(param int) (View, error) {
	if err := e.usable("GradView"); err != nil {
		return View{}, err
	}
	rg, err := e.plan.ShardRange(param, e.rank)
	if err != nil {
		return View{}, err
	}
	part := e.pl.gradShard().slice(rg.ShardOffset, rg.Count)
	copyScaled := func(op string, dst, src Tensor, inverse bool) error {
		if err := e.readable(op); err != nil {
			return err
		}
		scale := e.readScale
		if inverse {
			scale = float32(1 / float64(scale))
		}
		d, s := e.pl.shardSide(e.copyStream)
		return e.copyScaled(d, s, dst, src, scale)
	}
	return newView(param, rg, e.rank,
		func(dst []float32) error { return copyScaled("View.Read", Float32s(dst), part, false) },
		func(src []float32) error { return copyScaled("View.Write", part, Float32s(src), true) },
	), nil
}

// TrimPools frees the pooled buffers that are idle: staging buffers beyond
// Config.StagingBuffers (the pool grows when buckets complete out of order)
// and ZeRO-1's local accumulators between windows. The stats' resident
// bytes drop by as much; the next window allocates what it needs again.
func (e *Engine) TrimPools() error {
	if err := e.usable("TrimPools"); err != nil {
		return err
	}
	err := e.pl.trim()
	if err == nil && e.off != nil {
		err = e.off.trim()
	}
	if err != nil {
		return e.fail(err)
	}
	return nil
}

// ---- the optimizer -------------------------------------------------------------

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
		return errorf(ErrConfig, "SetGroup on an engine without an optimizer; configure Optimizer.Groups")
	}
	return e.opt.setGroup(g, o)
}

// LossScale is the scale the trainer multiplies each of the next
// backwards' loss by (1 unless fp16 or a static scale). With fp16 and
// Grads.AccumSteps G it is the loss scaler's scale divided by G, as
// DeepSpeed scales loss/G: the scaler's scale (Stats.LossScale) is that of
// the step's mean loss, the same at any G. Where G is counted
// (AccumSteps 0) each backward carries the whole scale.
func (e *Engine) LossScale() float64 {
	if e.opt == nil {
		return 1
	}
	return e.opt.lossScale()
}

// ---- stage 3 -------------------------------------------------------------------

// Gather makes the parameters ps available to work enqueued on stream s
// after it returns (stage 3): it all-gathers each bucket that holds one of
// them, unless it is gathered already, and returns a view of each
// parameter in its bucket's gathered buffer. s waits on the gathers'
// events; nothing blocks the caller. Each view holds a reference until
// Release; a bucket stays gathered while any of its parameters is
// referenced. Every rank must gather the same buckets in the same order:
// the gathers are collectives.
func (e *Engine) Gather(s Stream, ps ...int) ([]Tensor, error) {
	if err := e.checkGather("Gather", s, ps); err != nil {
		return nil, err
	}
	views, err := e.ps.gather(s, ps)
	if err != nil {
		return nil, e.fail(err)
	}
	return views, nil
}

// Release hands back one reference to each of the parameters ps, whose views
// the work enqueued on s so far has used. A bucket whose last reference goes
// returns its buffer to the pool, reused only after s (and every other
// stream that released it) has finished that work.
func (e *Engine) Release(s Stream, ps ...int) error {
	if err := e.checkGather("Release", s, ps); err != nil {
		return err
	}
	refused, err := e.ps.release(s, ps)
	if err != nil {
		return e.fail(err)
	}
	return refused
}

// ParamMemory reports the stage-3 parameter memory now (zero elsewhere).
func (e *Engine) ParamMemory() ParamMemory {
	if e.ps == nil {
		return ParamMemory{}
	}
	return e.ps.memory()
}

func (e *Engine) checkGather(op string, s Stream, ps []int) error {
	if err := e.usable(op); err != nil {
		return err
	}
	if e.cfg.Stage != 3 {
		return errorf(ErrProtocol, "%s at stage %d; parameters are sharded and gathered at stage 3 only", op, e.cfg.Stage)
	}
	if e.ps == nil {
		return errorf(ErrProtocol, "%s: the parameters were registered without memory; give Param.Data or Param.Init", op)
	}
	if err := e.ps.check(op, s, ps); err != nil {
		return err
	}
	if err := e.dev.checkStream(s); err != nil {
		return e.ownFailure(err, s)
	}
	e.callerStreams[s] = struct{}{}
	return nil
}

// ---- coalesced windows and NoSync -----------------------------------------------

// BeginCoalesce opens a coalesced window: the backwards until EndCoalesce
// sum their gradients locally, and EndCoalesce reduces each bucket once.
// It works at every stage; at stage 1, whose buckets are deferred anyway, it
// only makes the reduction happen at EndCoalesce.
func (e *Engine) BeginCoalesce() error { return e.beginWindow("BeginCoalesce", false) }

// BeginNoSync starts backwards that only accumulate, as DDP's no_sync: at
// every stage (DeepSpeed refuses it at 2 and 3), with the coalesced
// window's mechanism. The first backward after EndNoSync reduces what they
// accumulated together with its own gradients, each bucket once; a Step
// right after EndNoSync reduces it too.
func (e *Engine) BeginNoSync() error { return e.beginWindow("BeginNoSync", true) }

func (e *Engine) beginWindow(op string, noSync bool) error {
	if err := e.usable(op); err != nil {
		return err
	}
	if err := e.win.checkStart(op, e.inBackward); err != nil {
		return err
	}
	e.win.begin(noSync)
	e.endedBy = ""
	return nil
}

// EndCoalesce closes the window: each deferred bucket is reduced exactly once
// into the shard, on the engine's stream, and the modes return to the
// stage's. It acts as a boundary: Step may follow at once.
func (e *Engine) EndCoalesce() error {
	if err := e.usable("EndCoalesce"); err != nil {
		return err
	}
	if err := e.afterFailedWindow("EndCoalesce"); err != nil {
		return err
	}
	if err := e.win.checkEndCoalesce(e.inBackward); err != nil {
		return err
	}
	if err := e.win.endCoalesce(e.reduceStream); err != nil {
		return e.fail(err)
	}
	return nil
}

// EndNoSync ends the backwards that only accumulate.
func (e *Engine) EndNoSync() error {
	if err := e.usable("EndNoSync"); err != nil {
		return err
	}
	if err := e.afterFailedWindow("EndNoSync"); err != nil {
		return err
	}
	if err := e.win.checkEndNoSync(e.inBackward); err != nil {
		return err
	}
	e.win.endNoSync()
	return nil
}

// Coalesce runs fn, which takes several backwards, inside a coalesced
// window; fn's error, or the window's, is returned. The window always
// closes: when fn fails, every gradient taken since the last Step is
// dropped, as DiscardGrads drops them, and the window ends without
// reducing (every rank must see the failure, as with any failed step).
func (e *Engine) Coalesce(fn func() error) error {
	return e.within("Coalesce", e.BeginCoalesce, fn, e.EndCoalesce)
}

// NoSync runs fn's backwards without reducing them, as BeginNoSync and
// EndNoSync around it. When fn fails, NoSync ends, and every gradient taken
// since the last Step is dropped, as Coalesce does.
func (e *Engine) NoSync(fn func() error) error {
	return e.within("NoSync", e.BeginNoSync, fn, e.EndNoSync)
}

// afterFailedWindow refuses op, a window's end, right after a failed
// Coalesce or NoSync closed the window itself.
func (e *Engine) afterFailedWindow(op string) error {
	if e.endedBy == "" || !e.closedByEnd {
		return nil
	}
	return errorf(ErrProtocol, "%s right after %s, which closed its window and dropped every gradient since the last Step; leave it out, and take the step's backwards again from the first", op, e.endedBy)
}

// within runs fn between begin and end. When fn fails it drops the
// window's gradients and closes the window instead of ending it.
func (e *Engine) within(op string, begin, fn, end func() error) error {
	if err := begin(); err != nil {
		return err
	}
	if err := fn(); err != nil {
		discarded := e.DiscardGrads()
		e.win.abandon()
		if discarded == nil {
			e.endedBy, e.closedByEnd = "a failed "+op, true
		}
		return errors.Join(err, discarded)
	}
	return end()
}

// ---- checkpoints -------------------------------------------------------------------

// Save writes a checkpoint of the engine's state into dir (checkpoint.go):
// the fp32 master, the optimizer's moments and step counts, its groups as
// SetGroup left them, the loss scaler, the step count, the model-dtype
// shard (at stage 3 the parameters), the offloaded host state, and
// opt.Client, this rank's own bytes. Every rank calls it between steps
// (not inside a backward, a window or NoSync, and with nothing gathered at
// stage 3). dir is a directory all ranks share; the checkpoint becomes
// dir/step-N and dir/latest names it once every rank has written its
// part. It needs an optimizer: without one the engine holds no training
// state.
func (e *Engine) Save(dir string, opt SaveOptions) error {
	ce, err := e.checkpointable("Save")
	if err != nil {
		return err
	}
	if err := ce.save(dir, opt); err != nil {
		if errors.Is(err, ErrCheckpoint) || errors.Is(err, ErrConfig) {
			return err
		}
		return e.fail(err)
	}
	return nil
}

// Load replaces the engine's state with the checkpoint in dir (a
// checkpoint directory, or one whose latest names one) and reports what it
// did: this rank's Client bytes (on a rank the saving run did not have, a
// checkpoint of W ranks loaded into more, saved rank
// opt.NewRankClient's: rank 0's by default), the checkpoint's step, world
// size and stage, what was resharded, and where the settings came from.
// It is a load into an engine New has built, with the same parameters
// (names, shapes, dtypes, groups; in any order, as they are found by
// name), because New is where the settings are checked across ranks and
// the memory is laid out: the checkpoint fills that memory, whatever world
// size, stage, bucket size, alignment, offload or batch split
// (Grads.AccumSteps, Window.DType) wrote it (state is found by parameter
// and element range). A parameter one side has and the other lacks, or has
// otherwise, is refused, naming it. Set Params.NoBroadcast in the
// Config when you will load: the broadcast of the initial values is then
// wasted. The optimizer's groups are restored (SetGroup after Load
// overrides them), as is the step count; Optimizer.Clip and Schedule come
// from the engine's Config. Every rank calls it between steps. A damaged,
// incomplete or foreign checkpoint is refused (ErrCheckpoint, naming the
// file) before anything changes; an I/O error after every file was
// checked is fatal.
func (e *Engine) Load(dir string, opt LoadOptions) (LoadReport, error) {
	ce, err := e.checkpointable("Load")
	if err != nil {
		return LoadReport{}, err
	}
	rep, step, fatal, err := ce.load(dir, opt, newLossScaler(e.cfg.Precision.LossScale))
	if err != nil {
		if fatal {
			return LoadReport{}, e.fail(err)
		}
		return LoadReport{}, err
	}
	e.stepIndex = step
	return rep, nil
}

// ExportSafetensors writes the model into file, one safetensors file: each
// parameter's fp32 values by its name and shape (the fp32 master, also for
// a bf16 or fp16 model; a frozen parameter's Data, widened to fp32: zero
// holds nothing else of it, so rank 0's must be there), and with
// opt.Optimizer each parameter's optimizer state as torch names it. Every
// rank calls it between steps. Nothing is gathered: each rank writes the
// ranges its shard holds at offsets every rank computes alike, through at
// most one 8 MiB chunk of extra memory (none where the state is in host
// memory), so file must be on a file system every rank shares; it appears
// whole, or not at all (written under a temporary name, renamed once every
// rank has fsynced its part). CheckpointToSafetensors does the same from a
// checkpoint directory, without an engine.
func (e *Engine) ExportSafetensors(file string, opt ExportOptions) error {
	ce, err := e.checkpointable("ExportSafetensors")
	if err != nil {
		return err
	}
	if err := ce.export(file, opt); err != nil {
		if errors.Is(err, ErrCheckpoint) || errors.Is(err, ErrConfig) || errors.Is(err, ErrParam) || errors.Is(err, ErrDType) {
			return err
		}
		return e.fail(err)
	}
	return nil
}

// checkpointable refuses a save or load where the state is not at rest.
func (e *Engine) checkpointable(op string) (*ckptJob, error) {
	if err := e.usable(op); err != nil {
		return nil, err
	}
	switch {
	case e.opt == nil:
		return nil, errorf(ErrConfig, "%s without an optimizer: the engine holds no training state; set Optimizer.Groups", op)
	case e.inBackward || e.backwards > 0:
		return nil, errorf(ErrProtocol, "%s after a backward: call it between steps (after Step, before the next backward)", op)
	case e.win.open() || e.win.startsFlush():
		return nil, errorf(ErrProtocol, "%s inside a Coalesce window or NoSync: call it between steps", op)
	case e.ps != nil && e.ps.stillGathered() > 0:
		return nil, errorf(ErrProtocol, "%s with %d gathered parameter views out: Release them first", op, e.ps.stillGathered())
	}
	stop := func() error {
		if reason := e.aborted.Load(); reason != nil {
			return fmt.Errorf("%w: %s interrupted by Abort: %w", ErrAborted, op, *reason)
		}
		return nil
	}
	return newCkptJob(ckptSnapshot{fs: e.ckptFS(), comm: e.comm, rank: e.rank, world: e.world, stage: e.cfg.Stage, plan: e.plan,
		params: e.params, settings: e.Settings(), opt: e.opt, ps: e.ps, step: e.stepIndex, stop: stop}), nil
}

// ckptFS is the file layer checkpoints use (a test's, where one is set).
func (e *Engine) ckptFS() ckptFS {
	if e.files != nil {
		return e.files
	}
	return osFS{}
}

// ---- the end ---------------------------------------------------------------------

// Close waits for the work the engine enqueued (pending reductions, and
// reads of gradients into a bucket that never filled) and, at stage 3, for
// the streams that still hold gathered views, and frees the engine's
// memory. It does not close the communicator. Closing twice does
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
		errs = append(errs, e.opt.close())
	}
	if e.ps != nil {
		errs = append(errs, e.ps.close())
	}
	if e.off != nil {
		errs = append(errs, e.off.shutdown())
	}
	for _, s := range []Stream{e.reduceStream, e.gatherStream, e.copyStream} {
		if s != nil {
			errs = append(errs, s.Close())
		}
	}
	if e.check != nil {
		errs = append(errs, e.check.close())
	}
	if e.ends != nil {
		errs = append(errs, e.ends.close())
	}
	return errors.Join(errs...)
}
