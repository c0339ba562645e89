package zero

import "time"

// The stats of a step: each component (the pipeline, the window, the
// optimizer, stage 3's parameters, offload) fills its own figures into
// Stats and starts its next step's count; Step only gathers them.

// statsReporter is a component that reports its part of a step's stats.
type statsReporter interface {
	report(st *Stats) error
}

// collectStats fills st from every reporter, in order.
func collectStats(st *Stats, reporters []statsReporter) error {
	for _, r := range reporters {
		if err := r.report(st); err != nil {
			return err
		}
	}
	return nil
}

// Stats describes one step.
//
// Memory: every buffer the engine holds is counted in exactly one of
// PeakGradBytes (and its resident and pooled figures), OptimizerBytes,
// ControlBytes and PeakParamBytes on the device, and HostBytes on the host
// (HostGradBytes and HostParamBytes being parts of it). Estimation.Stats gives the same
// fields before the engine exists. Temporaries of New, Load, Save and the
// reads (GradShard, FullGrads, FullParams) are freed before the call
// returns and count in none.
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
	// engine holds on the device: the shard (not with Offload, which keeps
	// it on the host: HostGradBytes), the staging buffers and the local
	// sums (ZeRO-1's and a window's), in use or pooled. The peak is over
	// the window; it starts again from the resident bytes at Step.
	PeakGradBytes     int64
	ResidentGradBytes int64 // see PeakGradBytes
	// WindowResidentBytes is the gradient memory held at the end of a
	// coalesced window's (or NoSync's) last backward, before its flush: the
	// shard, the local sums and the staging buffers (0 without a window).
	WindowResidentBytes int64
	// PooledGradBytes is the part of ResidentGradBytes that the pools hold
	// idle at the end of the step, kept for the next window: a window's
	// sums stay pooled until a backward begins outside a window, and
	// TrimPools frees what is beyond the configured staging buffers.
	PooledGradBytes int64
	// The same figures less what the pools hold idle: the memory in use,
	// as PyTorch's memory_allocated counts it (its caching allocator being
	// the pools). GradBytesInUse is ResidentGradBytes − PooledGradBytes.
	PeakGradBytesInUse   int64 // see PeakGradBytes
	WindowGradBytesInUse int64 // see WindowResidentBytes
	GradBytesInUse       int64 // see ResidentGradBytes
	// ExposedReduceTime is the time from the end of the window's last
	// backward (its last gradient produced, on every stream that produced
	// in it) to the end of its last reduction: the part of the reductions
	// backward did not hide (with a window, the flush is all of it).
	// LastReduceTime is the last reduction's own time: the last bucket can
	// only be reduced once backward has produced it, so no overlap exposes
	// less.
	ExposedReduceTime time.Duration
	LastReduceTime    time.Duration // see ExposedReduceTime
	// NormReadBytes is what GradNorm read of the gradient shard after the
	// reductions: nothing where the step's last landing into each bucket
	// summed its squares as it stored them (the boundary known:
	// Grads.AccumSteps, SetBoundary(true), a window's or NoSync's flush,
	// ZeRO-1's flush at Step), the buckets' bytes where it did not.
	NormReadBytes int64
	// Overflow is set when a reduced gradient on this rank was inf or NaN.
	Overflow bool
	// With an optimizer: Skipped is set when every rank skipped the step
	// (an inf or NaN gradient on any rank, or a non-finite norm), leaving
	// master weights, optimizer state and parameters as they were;
	// GradNorm is the global norm of the gradient the step used (before
	// clipping, after unscaling; NaN or inf when it skipped for it);
	// LossScale is the loss scaler's scale in the window (DeepSpeed's: of
	// the step's mean loss), each backward carrying LossScale/G with fp16
	// and Grads.AccumSteps G (Engine.LossScale).
	Skipped   bool
	GradNorm  float64 // see Skipped
	LossScale float64 // see Skipped
	// LR is the learning rate of each optimizer group in the step, after
	// the schedule (Optimizer.Schedule, or the rate SetGroup set). A skipped
	// step gives the rate it would have used, which the next step uses
	// again: a skip does not advance the schedule, as in DeepSpeed. Nil
	// without Optimizer.Groups.
	LR []float64
	// OptimizerBytes is the optimizer's device memory on this rank: the
	// fp32 master shard and the moments, and the fp32 scratch a 16-bit
	// gradient shard is widened through bucket by bucket (all three on the
	// host with Offload, in HostBytes), the model-dtype shard of the new
	// parameters and the buffer they are all-gathered in (stages 1 and 2).
	OptimizerBytes int64
	// ControlBytes is the engine's small fixed device buffers: the overflow
	// flag, Step's check, and with an optimizer the norm's all-gather and
	// (without Offload) its sums of squares: 8 bytes per started 8192
	// elements of each bucket's shard, and 8 per bucket.
	ControlBytes int64
	// OptimizerTime is the device time of the fused optimizer pass (with
	// Offload, the host's), and ParamGatherTime that of the all-gather of
	// the new parameters into their memory (with Offload, from the end of
	// the optimizer's launches: the wait for each bucket's copy to the
	// device included; zero when the step skipped); at stage 3, that of the
	// window's gathers.
	OptimizerTime   time.Duration
	ParamGatherTime time.Duration // see OptimizerTime

	// Stage 3 with parameter shards: the parameter memory on the device
	// (the shard, none with Offload.Params, and the peak of shard plus
	// gather buffers over the window; ParamMemory tells it at any moment),
	// the gather buffers allocated, and the
	// window's buckets asked for that a prefetch had gathered (hits), that
	// were gathered on demand while a last order existed (misses), and that
	// were prefetched but never asked for (wasted).
	ParamShardBytes int64
	PeakParamBytes  int64 // see ParamShardBytes
	GatherBuffers   int   // see ParamShardBytes
	PrefetchHits    int   // see ParamShardBytes
	PrefetchMisses  int   // see ParamShardBytes
	PrefetchWasted  int   // see ParamShardBytes

	// With Offload: HostBytes is the engine's host memory (with
	// Offload.Optimizer the gradient shard, the master weights, the
	// optimizer state, the fp32 scratch a 16-bit shard is widened through,
	// the model-dtype copy of the new parameters (not with Offload.Params,
	// whose shard the step writes), the buffers reduced shards land in, the
	// overflow flag and the norm's chunk sums; with Offload.Params stage
	// 3's parameter shard), HostPinnedBytes the part of it that is
	// page-locked (all of it on a GPU; on the CPU device, what mlock
	// accepted), HostGradBytes the part that holds gradients (the shard and
	// the landing buffers, whatever the number of backwards),
	// HostParamBytes the part that holds the parameter shard,
	// DeviceBytesSaved the device memory the same engine holds without
	// Offload and this one does not (the gradient shard, the master weights
	// and the optimizer state; the parameter shard).
	HostBytes        int64
	HostPinnedBytes  int64 // see HostBytes
	HostGradBytes    int64 // see HostBytes
	HostParamBytes   int64 // see HostBytes
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

// backwardEnd marks, on the device's clock, when a window's last backward
// had produced its last gradient: a stream of its own waits for the last
// event of every stream that produced in the backward, then records a timed
// event. The reductions and offload's copies measure from it the part of
// their time that backward did not hide. The engine owns it; the
// components read it through exposure.
type backwardEnd struct {
	marks     Stream
	producers map[Stream]Event
	clock     stopwatch
	at        Event // the window's last backward's end; nil before one ended
}

func newBackwardEnd(dev Device) (*backwardEnd, error) {
	s, err := dev.NewStream()
	return &backwardEnd{marks: s, producers: map[Stream]Event{}}, err
}

// stream is the marks' own stream, which the engine syncs with its others.
func (b *backwardEnd) stream() Stream { return b.marks }

// produced notes ev as stream s's latest gradient of the backward.
func (b *backwardEnd) produced(s Stream, ev Event) { b.producers[s] = ev }

// mark ends a backward: the mark follows its producers' last events and
// replaces the previous backward's.
func (b *backwardEnd) mark() error {
	for _, ev := range b.producers {
		if err := b.marks.Wait(ev); err != nil {
			return err
		}
	}
	clear(b.producers)
	b.clock.release(b.at)
	var err error
	b.at, err = b.clock.mark(b.marks)
	return err
}

// restart forgets the window's marks (at Step after the reports, and for
// a dropped backward): the next window marks its own.
func (b *backwardEnd) restart() {
	clear(b.producers)
	b.clock.release(b.at)
	b.at = nil
}

// exposure measures spans (a stopwatch's, not yet taken) against the
// mark: the sum of their parts after it; how long after it the last span
// ended (0 when every span ended before it, or no backward ended); and the
// last span's own length, the least exposure overlap can reach (the last
// bucket is produced when backward ends).
func (b *backwardEnd) exposure(w *stopwatch) (after, tail, last time.Duration, err error) {
	var lastEnd Event
	for _, sp := range w.spans {
		if lastEnd != nil {
			d, err := Elapsed(lastEnd, sp[1])
			if err != nil {
				return 0, 0, 0, err
			}
			if d < 0 {
				continue
			}
		}
		lastEnd = sp[1]
		if last, err = Elapsed(sp[0], sp[1]); err != nil {
			return 0, 0, 0, err
		}
	}
	if b.at == nil {
		return 0, 0, last, nil
	}
	for _, sp := range w.spans {
		from, err := Elapsed(b.at, sp[0])
		if err != nil {
			return 0, 0, 0, err
		}
		to, err := Elapsed(b.at, sp[1])
		if err != nil {
			return 0, 0, 0, err
		}
		after += max(0, to-max(0, from))
		tail = max(tail, to)
	}
	return after, tail, last, nil
}

func (b *backwardEnd) close() error {
	if b.marks == nil {
		return nil
	}
	return b.marks.Close()
}

// DeviceBytes is one rank's device memory by kind. FrameworkParams is the
// framework's own; every other field is memory the engine allocates, and
// counts in one field of Stats: GradShard, Staging, LocalSums and
// WindowSums in PeakGradBytes; GradScratch, Master, OptimizerState,
// NewParams and ParamGather in OptimizerBytes; Control in ControlBytes;
// ParamShard and Gathered in PeakParamBytes.
type DeviceBytes struct {
	// FrameworkParams are the framework's model-dtype parameters: all of
	// them at stages 1 and 2 (the engine writes into them), the frozen ones
	// at stage 3 (the others may be freed after New).
	FrameworkParams int64
	ParamShard      int64 // stage 3: this rank's shard of the parameters, model dtype (on the host with Offload.Params)
	Gathered        int64 // stage 3: gather buffers (a set held, and the prefetch within its budgets)
	GradShard       int64 // the reduced gradient shard, in Precision.ShardDType
	GradScratch     int64 // fp32, the largest bucket shard: the optimizer reads a 16-bit shard widened through it
	Staging         int64 // staging buffers, comm dtype, one largest bucket each
	LocalSums       int64 // ZeRO-1's local sums: fp32, every bucket's elements, or padded in a 16-bit Window.DType
	WindowSums      int64 // a window's sums in Window.DType, the buckets it defers
	Master          int64 // fp32 master weights
	OptimizerState  int64 // AdamW's m and v (and amsgrad's maximum), SGD's momentum
	NewParams       int64 // stages 1-2: the model-dtype shard of the new parameters
	ParamGather     int64 // stages 1-2: the bucket buffer the new parameters are all-gathered in
	Control         int64 // the overflow flag, Step's check, the norm's chunk sums and its all-gather
}

// HostBytes is an offloading rank's page-locked host memory by kind: all of
// it in Stats.HostBytes, GradShard and Landing in Stats.HostGradBytes,
// ParamShard in Stats.HostParamBytes.
type HostBytes struct {
	ParamShard     int64 // Offload.Params: stage 3's shard of the parameters, model dtype
	GradShard      int64 // the gradient shard, in Precision.ShardDType
	GradScratch    int64 // fp32, the largest bucket shard: the optimizer reads a 16-bit shard widened through it
	Landing        int64 // buffers the reduced parts land in, comm dtype
	Master         int64 // fp32 master weights
	OptimizerState int64 // as DeviceBytes.OptimizerState
	NewParams      int64 // the host's model-dtype copy of the new parameters (none with Offload.Params: the step writes ParamShard)
	Control        int64 // the overflow flag and the norm's chunk sums
}

// Engine is the device memory the engine allocates: all but the
// framework's parameters.
func (d DeviceBytes) Engine() int64 { return d.Total() - d.FrameworkParams }

// Total is the engine's device memory and the framework's parameters.
func (d DeviceBytes) Total() int64 { return d.ModelStates() + d.Buffers() }

// ModelStates is what the ZeRO paper counts: parameters (the framework's
// and the stage-3 shard), gradients (the shard and the local sums) and
// optimizer state (master, moments, the new parameters' shard).
func (d DeviceBytes) ModelStates() int64 {
	return d.FrameworkParams + d.ParamShard + d.GradShard + d.LocalSums + d.WindowSums + d.Master + d.OptimizerState + d.NewParams
}

// Buffers is the rest: the working buffers of one or a few buckets.
func (d DeviceBytes) Buffers() int64 {
	return d.Gathered + d.GradScratch + d.Staging + d.ParamGather + d.Control
}

// Total is the engine's host memory.
func (h HostBytes) Total() int64 {
	return h.ParamShard + h.GradShard + h.GradScratch + h.Landing + h.Master + h.OptimizerState + h.NewParams + h.Control
}

// plus is d and o added field by field: the estimate adds up what each
// component says it allocates.
func (d DeviceBytes) plus(o DeviceBytes) DeviceBytes {
	return DeviceBytes{FrameworkParams: d.FrameworkParams + o.FrameworkParams, ParamShard: d.ParamShard + o.ParamShard,
		Gathered: d.Gathered + o.Gathered, GradShard: d.GradShard + o.GradShard, GradScratch: d.GradScratch + o.GradScratch,
		Staging: d.Staging + o.Staging, LocalSums: d.LocalSums + o.LocalSums, WindowSums: d.WindowSums + o.WindowSums,
		Master: d.Master + o.Master, OptimizerState: d.OptimizerState + o.OptimizerState, NewParams: d.NewParams + o.NewParams,
		ParamGather: d.ParamGather + o.ParamGather, Control: d.Control + o.Control}
}

// plus is h and o added field by field.
func (h HostBytes) plus(o HostBytes) HostBytes {
	return HostBytes{ParamShard: h.ParamShard + o.ParamShard, GradShard: h.GradShard + o.GradShard,
		GradScratch: h.GradScratch + o.GradScratch, Landing: h.Landing + o.Landing, Master: h.Master + o.Master,
		OptimizerState: h.OptimizerState + o.OptimizerState, NewParams: h.NewParams + o.NewParams, Control: h.Control + o.Control}
}
