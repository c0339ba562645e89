package zero

import (
	"errors"
	"time"
)

// CPU offload (Config.Offload): the fp32 gradient shard, the fp32 master
// weights and the optimizer state live in page-locked host memory. Each
// reduced shard is copied to the host on the copy stream, once its
// reduction's event fires, and a host kernel on the engine's host stream
// adds it into the host shard (copies it on the window's first reduction of
// the bucket). The optimizer runs on the host and the new model-dtype
// parameters go back to the device for the all-gather. On the CPU device the
// "device" buffers and the host ones are distinct mappings copied on the
// same streams, so this path runs, and is tested, on every machine.

// offloadPath moves reduced shards from the device to the host shard.
type offloadPath struct {
	dev     Device      // the engine's device: the copies run on its copy stream
	mem     *hostMemory // the host shard, master weights, optimizer state, landing buffers
	copy    Stream      // the engine's copy stream
	stream  *HostStream // host kernels: the adds into the host shard, the optimizer
	landing *bufferPool // comm dtype, the largest bucket shard: where a reduced shard lands
	maxLand int         // elements of a landing buffer
	keep    int         // landing buffers to start with and to trim to
	meter   memoryMeter // the landing pool's (hostMemory counts every host byte)

	gradCopies, paramCopies spans // the window's copies to the host, its step's to the device
	// marks is a stream of the device that only waits for the producers
	// of a backward (their last events, in producers) and then records
	// backwardEnd: the device's time when the window's last backward had
	// produced its last gradient.
	marks       Stream
	producers   map[Stream]Event
	backwardEnd Event
}

func newOffloadPath(dev Device, copyStream Stream, commDType DType, maxShard, keep int) (*offloadPath, error) {
	mem, err := newHostMemory(dev)
	if err != nil {
		return nil, err
	}
	o := &offloadPath{dev: dev, mem: mem, copy: copyStream, stream: NewHostStream(), maxLand: maxShard, keep: keep, producers: map[Stream]Event{}}
	o.landing = newBufferPool(mem, commDType, &o.meter)
	if o.marks, err = dev.NewStream(); err != nil {
		return o, err
	}
	return o, o.landing.grow(maxShard, keep)
}

// land copies mine, this rank's reduced part of a bucket, to the host once
// reduced fires, and accumulates it into shard at offset on the host stream:
// copy when first, add after, times scale, raising flag on inf or NaN (the
// device accumulate's arithmetic, on the host). copied fires when the copy
// has read mine; added when the host shard holds the sum.
func (o *offloadPath) land(mine Tensor, reduced Event, shard Tensor, offset int, first bool, scale float32, flag Tensor) (copied, added Event, err error) {
	pin, err := o.landing.get(o.maxLand)
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil { // the pool waits for what was enqueued
			o.stream.Wait(fence(o.copy))
			o.landing.put(pin, fence(o.stream))
		}
	}()
	dst := pin.t.slice(0, mine.count)
	if err = o.copy.Wait(pin.free); err != nil {
		return nil, nil, err
	}
	if err = o.copy.Wait(reduced); err != nil {
		return nil, nil, err
	}
	start, err := o.copy.Record()
	if err != nil {
		return nil, nil, err
	}
	if err = o.dev.copy(o.copy, dst, mine); err != nil {
		return nil, nil, err
	}
	if copied, err = o.copy.Record(); err != nil {
		return nil, nil, err
	}
	o.gradCopies = append(o.gradCopies, [2]Event{start, copied})
	if err = o.stream.Wait(copied); err != nil {
		return nil, nil, err
	}
	if err = hostDev.accumulate(o.stream, shard, []Segment{{Src: dst, Offset: offset}}, first, scale, flag); err != nil {
		return nil, nil, err
	}
	if added, err = o.stream.recordUntimed(nil); err != nil {
		return nil, nil, err
	}
	o.landing.put(pin, added)
	return copied, added, nil
}

// transfer copies src to dst (host to device or back) on the copy stream
// once after fires, and returns the copy's event; timed copies count in the
// step's ParamCopyTime.
func (o *offloadPath) transfer(dst, src Tensor, after Event, timed bool) (Event, error) {
	if err := o.copy.Wait(after); err != nil {
		return nil, err
	}
	var start Event
	var err error
	if timed {
		if start, err = o.copy.Record(); err != nil {
			return nil, err
		}
	}
	if err := o.dev.copy(o.copy, dst, src); err != nil {
		return nil, err
	}
	done, err := o.copy.Record()
	if err == nil && timed {
		o.paramCopies = append(o.paramCopies, [2]Event{start, done})
	}
	return done, err
}

// close frees the landing buffers and stops the host stream; the caller
// has waited for the work that used them.
func (o *offloadPath) close() error {
	errs := []error{o.landing.trim(0), o.stream.Close()}
	if o.marks != nil {
		errs = append(errs, o.marks.Close())
	}
	return errors.Join(errs...)
}

// discard forgets the producers of a dropped backward (DiscardGrads).
func (o *offloadPath) discard() {
	clear(o.producers)
	o.backwardEnd = nil
}

// endBackward marks the end of a backward on the device's clock: after
// its producers' last events.
func (o *offloadPath) endBackward() error {
	for _, ev := range o.producers {
		if err := o.marks.Wait(ev); err != nil {
			return err
		}
	}
	clear(o.producers)
	var err error
	o.backwardEnd, err = o.marks.Record()
	return err
}

// gradCopyTimes sums the window's copies to the host, and the part of them
// that ran after its last backward ended, and empties them.
func (o *offloadPath) gradCopyTimes() (total, exposed time.Duration, err error) {
	for _, sp := range o.gradCopies {
		d, err := Elapsed(sp[0], sp[1])
		if err != nil {
			return 0, 0, err
		}
		total += d
		if o.backwardEnd == nil {
			continue
		}
		from, err := Elapsed(o.backwardEnd, sp[0])
		if err != nil {
			return 0, 0, err
		}
		to, err := Elapsed(o.backwardEnd, sp[1])
		if err != nil {
			return 0, 0, err
		}
		exposed += max(0, to-max(0, from))
	}
	o.gradCopies = o.gradCopies[:0]
	o.backwardEnd = nil
	return total, exposed, nil
}

// shardSide is where the fp32 gradient shard and the optimizer's fp32 state
// live and are worked on: the device, on stream s; with Offload, the host,
// on the engine's host stream.
func (e *Engine) shardSide(s Stream) (Device, Stream) {
	if e.off != nil {
		return hostDev, e.off.stream
	}
	return e.dev, s
}

// offloadStats fills the stats' host memory figures.
func (e *Engine) offloadStats(st *Stats) error {
	if e.off == nil {
		return nil
	}
	st.HostBytes, st.HostPinnedBytes = e.off.mem.bytes, e.off.mem.locked
	st.HostGradBytes = int64(e.pl.shard.Bytes()) + int64(e.off.landing.held*e.off.maxLand*e.cfg.Precision.CommDType.Size())
	st.DeviceBytesSaved = int64(e.pl.shard.Bytes())
	if o := e.opt; o != nil {
		for _, t := range []Tensor{o.master, o.m, o.v, o.vmax} {
			st.DeviceBytesSaved += int64(t.Bytes())
		}
	}
	var err error
	if st.GradCopyTime, st.GradCopyExposed, err = e.off.gradCopyTimes(); err != nil {
		return err
	}
	st.ParamCopyTime, err = e.off.paramCopies.take()
	return err
}
