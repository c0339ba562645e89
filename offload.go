package zero

import (
	"errors"
)

// CPU offload (Config.Offload.Optimizer): the fp32 gradient shard, the
// fp32 master weights and the optimizer state live in page-locked host
// memory. The offload is two things the engine hands to the others: the
// pipeline's sink (each reduced part is copied to the host on the copy
// stream once its reduction's event fires, and a host kernel on the
// offload's own host stream adds it into the host shard, copying on the
// window's first reduction of the bucket) and the optimizer's home (the
// state's memory, and the fused pass run on the host bucket by bucket, each
// bucket's new model-dtype parameters copied back to the device while the
// host works on the next). On the CPU device the "device" buffers and the
// host ones are distinct mappings copied on the same streams, so this path
// runs, and is tested, on every machine. With Offload.Params too, the
// model-dtype shard the pass writes is stage 3's parameter shard, itself in
// page-locked memory (params.go): the pass writes it in place and nothing
// is copied back.

// offload is an offloading engine's host side.
type offload struct {
	dev     Device      // the engine's device: the copies run on its copy stream
	plan    *Plan       // the host pass runs bucket by bucket
	mem     *hostMemory // every host byte: the shard, the state, the landing buffers
	copy    Stream      // the engine's copy stream
	stream  *HostStream // host kernels: the adds into the host shard, the optimizer
	landing *bufferPool // comm dtype, the largest bucket shard: where a reduced part lands
	maxLand int         // elements of a landing buffer
	keep    int         // landing buffers to start with and to trim to
	meter   memoryMeter // the landing pool's (hostMemory counts every host byte)

	sum, raised Tensor     // the host shard and the overflow flag
	norm        *shardNorm // the host shard's sums of squares; nil without an optimizer
	scratch     Tensor     // fp32, the largest bucket shard: a 16-bit shard widened for the optimizer
	host        Tensor     // the host's model-dtype copy of the new parameters (none with modelOnHost)
	// modelOnHost: the model-dtype shard the pass is given is host memory
	// (stage 3's offloaded parameter shard), written in place
	modelOnHost bool
	// saved is the device memory this engine does not hold: the shard and
	// the optimizer's state, allocated here.
	saved int64

	gradCopies, paramCopies stopwatch    // the window's copies to the host, its step's to the device
	ends                    *backwardEnd // the engine's: when the window's last backward ended
}

// offloadSpec is what the offload needs of the engine.
type offloadSpec struct {
	dev                   Device      // the engine's device
	mem                   *hostMemory // the engine's page-locked memory
	plan                  *Plan
	copy                  Stream // the engine's copy stream
	commDType, shardDType DType
	keep                  int  // landing buffers (Config.StagingBuffers)
	withNorm              bool // keep the shard's sums of squares (an optimizer)
	modelOnHost           bool // the parameter shard is host memory (Offload.Params)
	ends                  *backwardEnd
}

// offloadSize is what newOffload allocates in page-locked memory: the
// shard in shardDType, its fp32 scratch where that is 16-bit (the optimizer
// reads it widened, bucket by bucket), keep landing buffers of the largest
// bucket shard in commDType, the overflow flag and (withNorm) the norm's
// chunk sums.
func offloadSize(plan *Plan, commDType, shardDType DType, keep int, withNorm bool) HostBytes {
	maxShard := int64(maxShardElems(plan))
	h := HostBytes{GradShard: int64(plan.ShardElems * shardDType.Size()), Control: 4,
		Landing: int64(keep) * maxShard * int64(commDType.Size())}
	if shardDType != FP32 {
		h.GradScratch = maxShard * 4
	}
	if withNorm {
		h.Control += normSumsBytes(plan)
	}
	return h
}

func newOffload(sp offloadSpec) (*offload, error) {
	plan, mem := sp.plan, sp.mem
	maxShard := maxShardElems(plan)
	o := &offload{dev: sp.dev, plan: plan, mem: mem, copy: sp.copy, stream: NewHostStream(), maxLand: maxShard, keep: sp.keep, ends: sp.ends,
		modelOnHost: sp.modelOnHost}
	o.landing = newBufferPool(mem, sp.commDType, &o.meter)
	var err error
	if o.sum, err = o.Alloc(plan.ShardElems, sp.shardDType); err != nil {
		return o, err
	}
	if sp.shardDType != FP32 { // the optimizer reads a 16-bit shard widened, bucket by bucket
		if o.scratch, err = mem.Alloc(maxShard, FP32); err != nil {
			return o, err
		}
	}
	if o.raised, err = mem.Alloc(1, FP32); err != nil {
		return o, err
	}
	if sp.withNorm {
		if o.norm, err = newShardNorm(hostDev, mem, plan); err != nil {
			return o, err
		}
	}
	return o, o.landing.grow(maxShard, sp.keep)
}

// ---- the pipeline's sink ----------------------------------------------------------

func (o *offload) shard() Tensor                       { return o.sum }
func (o *offload) flag() Tensor                        { return o.raised }
func (o *offload) side(Stream) (Device, Stream)        { return hostDev, o.stream }
func (o *offload) deviceBytes() int64                  { return 0 }
func (o *offload) controlBytes() int64                 { return 0 } // the flag and the sums are host memory
func (o *offload) newWindow()                          { o.norm.forget() }
func (o *offload) lend(int, int, DType) (Tensor, bool) { return Tensor{}, false } // the shard is host memory
func (o *offload) close() error {
	return errors.Join(o.Free(o.sum), o.mem.Free(o.raised), o.norm.close())
}

func (o *offload) squares(Stream) (float64, int64, error) { return o.norm.squares(o.stream, o.sum) }
func (o *offload) drainHost() error                       { return o.stream.Sync() }
func (o *offload) hostStream() *HostStream                { return o.stream }
func (o *offload) landingBuffers() (held, n int)          { return o.landing.held, o.maxLand }
func (o *offload) trim() error                            { return o.landing.trim(o.keep) }
func (o *offload) hostBytes() (held, locked int64)        { return o.mem.bytes, o.mem.locked }

// land copies mine, this rank's reduced part of a bucket, to the host once
// rs has reduced it, and accumulates it into the host shard at offset on
// the host stream: copy when first, add after, times scale, raising the
// flag on inf or NaN (the device accumulate's arithmetic, on the host).
func (o *offload) land(rs Stream, mine Tensor, b, offset int, first bool, scale float32, last bool) (landing, error) {
	reduced, err := record(rs)
	if err != nil {
		return landing{read: fence(rs)}, err
	}
	pin, err := o.landing.get(o.maxLand)
	if err != nil {
		return landing{read: reduced}, err
	}
	fail := func(err error) (landing, error) { // the pool and mine wait for what was enqueued
		o.copy.Wait(fence(rs))
		o.stream.Wait(fence(o.copy))
		o.landing.put(pin, fence(o.stream))
		return landing{read: fence(o.copy)}, err
	}
	dst := pin.t.slice(0, mine.count)
	if err := o.copy.Wait(pin.free); err != nil {
		return fail(err)
	}
	if err := o.copy.Wait(reduced); err != nil {
		return fail(err)
	}
	start, err := o.gradCopies.mark(o.copy)
	if err != nil {
		return fail(err)
	}
	if err := o.dev.copy(o.copy, dst, mine); err != nil {
		return fail(err)
	}
	copied, err := record(o.copy)
	if err != nil {
		return fail(err)
	}
	end, err := o.gradCopies.mark(o.copy)
	if err != nil {
		return fail(err)
	}
	o.gradCopies.add(start, end)
	if err := o.stream.Wait(copied); err != nil {
		return fail(err)
	}
	if err := landInto(hostDev, o.stream, o.sum, dst, b, offset, first, scale, o.raised, o.norm, last); err != nil {
		return fail(err)
	}
	added, err := o.stream.recordUntimed(nil)
	if err != nil {
		return fail(err)
	}
	o.landing.put(pin, added)
	return landing{read: copied, reduced: reduced, pending: []streamEvent{{rs, reduced}, {o.copy, copied}, {o.stream, added}}}, nil
}

// onDevice copies the host shard into scratch (device memory) for a
// collective on s.
func (o *offload) onDevice(s Stream, scratch Tensor) (Tensor, error) {
	copied, err := o.transfer(scratch, o.sum, nil, false)
	if err == nil {
		err = s.Wait(copied)
	}
	return scratch, err
}

// transfer copies src to dst (host to device or back) on the copy stream
// once after fires, and returns the copy's event; timed copies count in the
// step's ParamCopyTime.
func (o *offload) transfer(dst, src Tensor, after Event, timed bool) (Event, error) {
	if err := o.copy.Wait(after); err != nil {
		return nil, err
	}
	var start Event
	var err error
	if timed {
		if start, err = o.paramCopies.mark(o.copy); err != nil {
			return nil, err
		}
	}
	if err := o.dev.copy(o.copy, dst, src); err != nil {
		return nil, err
	}
	done, err := record(o.copy)
	if err == nil && timed {
		var end Event
		if end, err = o.paramCopies.mark(o.copy); err == nil {
			o.paramCopies.add(start, end)
		}
	}
	return done, err
}

// ---- the optimizer's home ---------------------------------------------------------

// Alloc allocates optimizer state (and the shard) in host memory; Free
// frees it. Both count the device bytes the offload saves.
func (o *offload) Alloc(count int, d DType) (Tensor, error) {
	t, err := o.mem.Alloc(count, d)
	if err == nil {
		o.saved += int64(t.Bytes())
	}
	return t, err
}

func (o *offload) Free(t Tensor) error {
	o.saved -= int64(t.Bytes())
	return o.mem.Free(t)
}

// loadMaster fills master from the model-dtype shard model on the device
// (written on s), through the host's copy of it, which then mirrors it; a
// shard in host memory (modelOnHost) is read where it is.
func (o *offload) loadMaster(s Stream, master, model Tensor) error {
	if o.host.ptr == 0 && model.count > 0 && !o.modelOnHost {
		var err error
		if o.host, err = o.mem.Alloc(model.count, model.dtype); err != nil {
			return err
		}
	}
	src := model
	ev, err := record(s)
	if err == nil && !o.modelOnHost {
		ev, err = o.transfer(o.host, model, ev, false)
		src = o.host
	}
	if err == nil {
		err = o.stream.Wait(ev)
	}
	if err == nil {
		err = hostDev.cast(o.stream, master, src, 1)
	}
	if err == nil {
		err = o.stream.Sync()
	}
	return err
}

// pass runs the fused optimizer on the host shard bucket by bucket, each
// bucket's new parameters copied to model (the device's model-dtype shard)
// as soon as they are written, while the host works on the next; a model
// shard in host memory (modelOnHost) is written in place. It returns, per
// bucket, the event after which model holds them (nil where this rank
// updated nothing in the bucket).
func (o *offload) pass(_ Stream, kind optKind, b optTensors, ranges []optRange, gscale float32, model Tensor) ([]Event, error) {
	b.out = o.host
	if o.modelOnHost {
		b.out = model
	}
	ready := make([]Event, len(o.plan.Buckets))
	err := eachBucket(o.plan, ranges, func(bi int, bp BucketPlan, part []optRange) error {
		sub := b.slice(bp.ShardOffset, bp.Shard)
		run := func(g Tensor) error {
			sub.g = g
			return hostDev.optimize(o.stream, kind, sub, part, gscale)
		}
		var err error
		if b.g.dtype == FP32 {
			err = run(sub.g)
		} else {
			err = widened(hostDev, o.stream, b.g, o.scratch, bp, run)
		}
		if err != nil {
			return err
		}
		written, err := o.stream.recordUntimed(nil)
		if err != nil || o.modelOnHost {
			ready[bi] = written
			return err
		}
		first, last := part[0].offset, part[len(part)-1].offset+part[len(part)-1].count
		at, n := bp.ShardOffset+int(first), int(last-first)
		ready[bi], err = o.transfer(model.slice(at, n), o.host.slice(at, n), written, true)
		return err
	})
	return ready, err
}

// ---- stats -------------------------------------------------------------------------

// report fills the step's gradient host figures and the device bytes the
// offload saves (the host memory's own count reports HostBytes) and its
// copy times, and starts the next step's.
func (o *offload) report(st *Stats) error {
	st.HostGradBytes = int64(o.sum.Bytes()) + int64(o.landing.held*o.maxLand*o.landing.dtype.Size())
	st.DeviceBytesSaved += o.saved
	var err error
	if st.GradCopyExposed, _, _, err = o.ends.exposure(&o.gradCopies); err != nil {
		return err
	}
	if st.GradCopyTime, err = o.gradCopies.take(); err != nil {
		return err
	}
	st.ParamCopyTime, err = o.paramCopies.take()
	return err
}

// shutdown frees the landing buffers and the host's model copy, and stops
// the host stream; the caller has waited for the work that used them, and
// the shard and the state were freed by their owners.
func (o *offload) shutdown() error {
	return errors.Join(o.landing.trim(0), o.mem.Free(o.host), o.mem.Free(o.scratch), o.stream.Close())
}
