package zero

import "errors"

// ZeRO-3 parameters. Each rank keeps its shard of every bucket's parameters
// in the model dtype (the plan's shard layout, the optimizer's output).
// Gather all-gathers whole buckets into pooled buffers on the gather stream
// and hands out views of the parameters in them, reference-counted per
// parameter; Release hands them back, and a bucket's buffer returns to the
// pool once every stream that used it is done. From the second window on,
// the engine prefetches buckets in the order the last window gathered them.

// gathered is the state of one bucket's gathered copy.
type gathered struct {
	buf        *buffer // nil while the bucket is not gathered
	ready      Event   // fires when the all-gather has landed
	users      []Event // one per Release: the user's stream, done with the view
	refs       int     // parameters' references
	prefetched bool    // gathered ahead, not yet asked for
}

// paramState is a stage-3 engine's parameter memory.
type paramState struct {
	shard   Tensor // model dtype, this rank's shard of every bucket
	pool    *bufferPool
	mem     memoryMeter // shard + gather buffers, in use or idle
	buckets []gathered
	refs    []int // per parameter

	gatheredBytes int64 // buffers holding a gathered bucket

	// The prefetch: the buckets in the order this window first asked for
	// them, the last window's order, and how far this window has followed it.
	order, last []int
	cursor      int
	hits        int // buckets asked for that a prefetch had gathered
	misses      int // buckets gathered on demand while a last order existed
	wasted      int // prefetched buckets never asked for before Step

	prefetchBytes, liveBytes int64 // 0: no limit on the live bytes

	times spans // the window's gathers, for the stats
}

// ParamMemory is a stage-3 engine's parameter memory on this rank, in bytes.
type ParamMemory struct {
	ShardBytes    int64 // this rank's shard of every bucket's parameters
	GatheredBytes int64 // gather buffers holding a gathered bucket now
	PooledBytes   int64 // idle gather buffers kept for the next gathers
	// PeakBytes is the most of ShardBytes + GatheredBytes + PooledBytes since
	// the last Step.
	PeakBytes       int64
	GatheredBuckets int // buckets gathered now
	Buffers         int // gather buffers allocated, in use or idle
}

// initParamShards fills the stage-3 parameter shard: from the parameters'
// memory (rank 0's, unless NoBroadcast) and from the initialisers of a
// sharded build, each called for this rank's ranges only.
func (e *Engine) initParamShards() error {
	ps := &paramState{refs: make([]int, len(e.params)), buckets: make([]gathered, len(e.plan.Buckets))}
	e.ps = ps
	ps.pool = newBufferPool(e.dev, e.plan.dtype, &ps.mem)
	ps.prefetchBytes = int64(e.cfg.Params.PrefetchBytes)
	ps.liveBytes = int64(e.cfg.Params.LiveParamBytes)
	var err error
	if ps.shard, err = e.dev.Alloc(e.plan.ShardElems, e.plan.dtype); err != nil {
		return err
	}
	ps.mem.add(int64(ps.shard.Bytes()))
	s := e.reduceStream
	if err := e.dev.zero(s, ps.shard); err != nil {
		return err
	}
	if err := e.loadParams(ps.pool, ps.shard); err != nil {
		return err
	}
	for i, p := range e.params {
		if p.Init == nil || p.Frozen {
			continue
		}
		rg := e.plan.shardRange(i, e.rank)
		if rg.Count == 0 {
			continue
		}
		host := make([]float32, rg.Count)
		if err := p.Init(host, rg.ParamOffset); err != nil {
			return errorf(ErrParam, "Init of parameter %d (%q) at offset %d: %v", i, p.Name, rg.ParamOffset, err)
		}
		if err := e.uploadCast(s, ps.shard.slice(rg.ShardOffset, rg.Count), host); err != nil {
			return err
		}
	}
	return s.Sync()
}

// uploadCast writes host fp32 values into device memory of any dtype.
func (e *Engine) uploadCast(s Stream, dst Tensor, host []float32) error {
	tmp, err := e.dev.Alloc(len(host), FP32)
	if err != nil {
		return err
	}
	err = e.dev.copy(s, tmp, Float32s(host))
	if err == nil {
		err = e.dev.cast(s, dst, tmp, 1)
	}
	if err == nil {
		err = s.Sync()
	}
	return errors.Join(err, e.dev.Free(tmp))
}

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
	st := e.ps
	views := make([]Tensor, len(ps))
	waited := -1 // the bucket s last waited for: members of a bucket come together
	for i, p := range ps {
		b := e.plan.ParamBucket[p]
		if b < 0 {
			views[i] = Tensor{dtype: e.plan.dtype}
			continue
		}
		g := &st.buckets[b]
		if g.refs == 0 { // asked for anew (a prefetched bucket has no reference yet)
			e.followOrder(b)
			switch {
			case g.prefetched:
				st.hits++
				g.prefetched = false
			case g.buf == nil:
				if st.last != nil {
					st.misses++
				}
				if err := e.gatherBucket(b); err != nil {
					return nil, e.fail(err)
				}
			}
		}
		if b != waited {
			if err := s.Wait(g.ready); err != nil {
				return nil, e.fail(err)
			}
			waited = b
		}
		g.refs++
		st.refs[p]++
		views[i] = g.buf.t.slice(e.plan.ParamOffset[p], e.params[p].Count)
	}
	if err := e.prefetch(); err != nil {
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
	st := e.ps
	for i, p := range ps {
		want := 1 // references ps hands back for p, up to this one
		for _, q := range ps[:i] {
			if q == p {
				want++
			}
		}
		if e.plan.ParamBucket[p] >= 0 && st.refs[p] < want {
			return errorf(ErrProtocol, "Release of parameter %d (%q), which is not gathered (or released already); release what Gather returned, once", p, e.params[p].Name)
		}
	}
	used, err := s.Record()
	if err != nil {
		return e.fail(err)
	}
	for _, p := range ps {
		b := e.plan.ParamBucket[p]
		if b < 0 {
			continue
		}
		g := &st.buckets[b]
		st.refs[p]--
		g.refs--
		g.users = append(g.users, used)
		if g.refs == 0 {
			if e.usedSoon(b) { // keep it for its next use, as a prefetch would gather it
				g.prefetched = true
				continue
			}
			if err := e.dropBucket(b); err != nil {
				return e.fail(err)
			}
		}
	}
	return nil
}

// ParamMemory reports the stage-3 parameter memory now (zero elsewhere).
func (e *Engine) ParamMemory() ParamMemory {
	st := e.ps
	if st == nil {
		return ParamMemory{}
	}
	n := 0
	for _, g := range st.buckets {
		if g.buf != nil {
			n++
		}
	}
	return ParamMemory{ShardBytes: int64(st.shard.Bytes()), GatheredBytes: st.gatheredBytes, PooledBytes: st.pool.bytes,
		PeakBytes: st.mem.peak, GatheredBuckets: n, Buffers: st.pool.held}
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
	if s == nil {
		return errorf(ErrStream, "%s with a nil stream; pass the stream that uses the parameters", op)
	}
	for _, p := range ps {
		if p < 0 || p >= len(e.params) {
			return errorf(ErrParam, "%s of parameter %d; registered parameters are 0..%d", op, p, len(e.params)-1)
		}
		if e.params[p].Frozen {
			return errorf(ErrParam, "%s of parameter %d (%q), which is frozen: it is not sharded; use its own memory", op, p, e.params[p].Name)
		}
	}
	return nil
}

// gatherBucket all-gathers bucket b from every rank's parameter shard into a
// pooled buffer on the gather stream.
func (e *Engine) gatherBucket(b int) error {
	st, bp, s := e.ps, &e.plan.Buckets[b], e.gatherStream
	buf, err := st.pool.get(e.plan.MaxBucket())
	if err != nil {
		return err
	}
	g := &st.buckets[b]
	var start Event
	err = s.Wait(buf.free)
	if err == nil {
		start, err = s.Record()
	}
	if err == nil {
		err = e.comm.AllGather(s, st.shard.slice(bp.ShardOffset, bp.Shard), buf.t.slice(0, bp.Padded))
	}
	var ready Event
	if err == nil {
		e.pl.sent.add(KindAllGather, bp.Padded*e.plan.dtype.Size(), e.world)
		ready, err = s.Record()
	}
	if err != nil {
		st.pool.put(buf, fence(s))
		return err
	}
	g.buf, g.ready, g.users = buf, ready, g.users[:0]
	st.times = append(st.times, [2]Event{start, ready})
	st.gatheredBytes += int64(buf.t.Bytes())
	return nil
}

// dropBucket returns bucket b's buffer to the pool, free once the gather
// and every stream that released it are done with it.
func (e *Engine) dropBucket(b int) error {
	st, s := e.ps, e.gatherStream
	g := &st.buckets[b]
	for _, u := range g.users {
		if err := s.Wait(u); err != nil {
			return err
		}
	}
	free, err := s.Record()
	if err != nil {
		free = fence(s)
	}
	st.pool.put(g.buf, free)
	st.gatheredBytes -= int64(g.buf.t.Bytes())
	*g = gathered{users: g.users[:0]}
	return err
}

// followOrder notes that bucket b was asked for: this window's order, and
// the place in the last window's order to prefetch from.
func (e *Engine) followOrder(b int) {
	st := e.ps
	st.order = append(st.order, b)
	for j := st.cursor; j < len(st.last); j++ {
		if st.last[j] == b {
			st.cursor = j + 1
			return
		}
	}
}

// usedSoon reports whether bucket b comes within the prefetch's reach of
// the last window's order, from where this window has got to.
func (e *Engine) usedSoon(b int) bool {
	st := e.ps
	if st.prefetchBytes <= 0 {
		return false
	}
	size := int64(e.plan.MaxBucket() * e.plan.dtype.Size())
	reach := max(1, int(st.prefetchBytes/size))
	for j := st.cursor; j < len(st.last) && j < st.cursor+reach; j++ {
		if st.last[j] == b {
			return st.liveBytes == 0 || st.gatheredBytes <= st.liveBytes
		}
	}
	return false
}

// prefetch gathers the buckets that come next in the last window's order,
// up to PrefetchBytes ahead and within LiveParamBytes.
func (e *Engine) prefetch() error {
	st := e.ps
	if st.prefetchBytes <= 0 {
		return nil
	}
	ahead, size := int64(0), int64(e.plan.MaxBucket()*e.plan.dtype.Size())
	for _, g := range st.buckets {
		if g.prefetched {
			ahead += size
		}
	}
	// at least one bucket ahead, whatever its size
	for j := st.cursor; j < len(st.last) && (ahead == 0 || ahead+size <= st.prefetchBytes); j++ {
		b := st.last[j]
		if st.buckets[b].buf != nil {
			continue
		}
		if st.liveBytes > 0 && st.gatheredBytes+size > st.liveBytes {
			return nil
		}
		if err := e.gatherBucket(b); err != nil {
			return err
		}
		st.buckets[b].prefetched = true
		ahead += size
	}
	return nil
}

// endParamWindow runs at Step before the optimizer: every parameter must have
// been released (checked by every rank in the window's all-reduce), and
// prefetched buckets nobody asked for are dropped. The optimizer's pass on
// the reduce stream waits for the gathers that read the shard.
func (e *Engine) endParamWindow() error {
	st := e.ps
	for b := range st.buckets {
		if st.buckets[b].prefetched {
			st.wasted++
			if err := e.dropBucket(b); err != nil {
				return err
			}
		}
	}
	ev, err := e.gatherStream.Record()
	if err == nil {
		err = e.reduceStream.Wait(ev)
	}
	st.last, st.order, st.cursor = append(st.last[:0], st.order...), st.order[:0], 0
	return err
}

// stillGathered counts the parameter references not yet released.
func (e *Engine) stillGathered() int {
	if e.ps == nil {
		return 0
	}
	n := 0
	for _, r := range e.ps.refs {
		n += r
	}
	return n
}

// close waits for the gathers and the users of gathered buffers, and frees
// the parameter memory.
func (st *paramState) close(dev Device) error {
	var errs []error
	for b := range st.buckets {
		g := &st.buckets[b]
		if g.buf == nil {
			continue
		}
		for _, u := range g.users {
			errs = append(errs, u.Sync())
		}
		if g.ready != nil {
			errs = append(errs, g.ready.Sync())
		}
		st.pool.put(g.buf, nil)
		g.buf = nil
	}
	errs = append(errs, st.pool.trim(0))
	if st.shard.ptr != 0 {
		errs = append(errs, dev.Free(st.shard))
		st.shard = Tensor{}
	}
	return errors.Join(errs...)
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
	out := make([][]float32, len(e.params))
	wide, err := e.dev.Alloc(max(e.plan.MaxBucket(), maxCount(e.params)), FP32)
	if err != nil {
		return nil, err
	}
	defer e.dev.Free(wide)
	s := e.gatherStream
	read := func(src Tensor) ([]float32, error) { // any dtype, on the device, to host fp32
		host := make([]float32, src.count)
		err := e.dev.cast(s, wide.slice(0, src.count), src, 1)
		if err == nil {
			err = e.dev.copy(s, Float32s(host), wide.slice(0, src.count))
		}
		if err == nil {
			err = s.Sync()
		}
		return host, err
	}
	if e.ps == nil {
		for p, q := range e.params {
			if q.Data.count > 0 {
				if out[p], err = read(q.Data); err != nil {
					return nil, e.fail(err)
				}
			}
		}
		return out, nil
	}
	ev, err := e.reduceStream.Record() // the last Step's writes into the shard
	if err == nil {
		err = s.Wait(ev)
	}
	if err != nil {
		return nil, e.fail(err)
	}
	buf, err := e.dev.Alloc(e.plan.MaxBucket(), e.plan.dtype)
	if err != nil {
		return nil, err
	}
	defer e.dev.Free(buf)
	for _, bp := range e.plan.Buckets {
		t := buf.slice(0, bp.Padded)
		if err := e.comm.AllGather(s, e.ps.shard.slice(bp.ShardOffset, bp.Shard), t); err != nil {
			return nil, e.fail(err)
		}
		flat, err := read(t)
		if err != nil {
			return nil, e.fail(err)
		}
		for _, p := range bp.Params {
			off := e.plan.ParamOffset[p]
			out[p] = append([]float32(nil), flat[off:off+e.params[p].Count]...)
		}
	}
	for p, q := range e.params { // frozen parameters keep their own memory
		if q.Frozen && q.Data.count > 0 {
			if out[p], err = read(q.Data); err != nil {
				return nil, e.fail(err)
			}
		}
	}
	return out, nil
}

func maxCount(params []Param) int {
	n := 0
	for _, p := range params {
		n = max(n, p.Count)
	}
	return n
}
