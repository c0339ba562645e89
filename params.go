package zero

import (
	"errors"
	"slices"
)

// ZeRO-3 parameters. Each rank keeps its shard of every bucket's parameters
// in the model dtype (the plan's shard layout, the optimizer's output).
// Gather all-gathers whole buckets into pooled buffers on the gather stream
// and hands out views of the parameters in them, reference-counted per
// parameter; Release hands them back, and a bucket's buffer returns to the
// pool once every stream that used it is done. From the second window on,
// the engine prefetches buckets in the order the last window gathered them.
// With Offload.Params the shard lives in page-locked host memory: a gather
// first copies this rank's part into its place in the gather buffer, on the
// gather stream, and all-gathers in place, so the device holds no shard.

// gathered is the state of one bucket's gathered copy.
type gathered struct {
	buf        *buffer  // nil while the bucket is not gathered
	ready      Event    // fires when the all-gather has landed
	users      []Event  // one per Release: the user's stream, done with the view
	holders    []Stream // the streams that gathered it: Close waits for them while views are out
	refs       int      // parameters' references
	prefetched bool     // gathered ahead, not yet asked for
}

// paramState is a stage-3 engine's parameter memory.
type paramState struct {
	dev    Device
	comm   Comm
	plan   *Plan
	params []Param
	world  int
	// gathers run on gs; the step's updates of the shard run on rs, which
	// the gathers must wait for and which must wait for them
	gs, rs Stream

	shard Tensor // model dtype, this rank's shard of every bucket
	// host, with Offload.Params, holds the shard in page-locked host
	// memory (nil: the shard is device memory)
	host    *hostMemory
	pool    *bufferPool
	mem     memoryMeter // the device's: shard (unless offloaded) + gather buffers, in use or idle
	buckets []gathered
	refs    []int // per parameter
	// asked marks the parameters a caller's Gather named since the last
	// Step (the prefetch's gathers do not count): a gradient of any other
	// came from a forward that read no gathered view.
	asked []bool

	gatheredBytes int64 // buffers holding a gathered bucket

	// The prefetch: the buckets in the order this window first asked for
	// them, the last window's order, and how far this window has followed it.
	order, last []int
	cursor      int
	hits        int // buckets asked for that a prefetch had gathered
	misses      int // buckets gathered on demand while a last order existed
	wasted      int // prefetched buckets never asked for before Step

	prefetchBytes, liveBytes int64 // 0: no limit on the live bytes

	times stopwatch    // the window's gathers, for the stats
	sent  CommCounters // the window's gathers, for the stats
}

// ParamMemory is a stage-3 engine's parameter memory on this rank, in bytes.
type ParamMemory struct {
	ShardBytes int64 // this rank's shard of every bucket's parameters, on the device (0 with Offload.Params)
	// HostShardBytes is the same shard in page-locked host memory, with
	// Offload.Params (0 without)
	HostShardBytes int64
	GatheredBytes  int64 // gather buffers holding a gathered bucket now
	PooledBytes    int64 // idle gather buffers kept for the next gathers
	// PeakBytes is the most of ShardBytes + GatheredBytes + PooledBytes since
	// the last Step.
	PeakBytes       int64
	GatheredBuckets int // buckets gathered now
	Buffers         int // gather buffers allocated, in use or idle
}

// loadSpec is what loading the parameters into a shard needs.
type loadSpec struct {
	dev       Device
	comm      Comm
	s         Stream
	plan      *Plan
	params    []Param
	broadcast bool // rank 0's values to every rank first
}

// loadShard gives every rank rank 0's parameters (unless ld.broadcast is
// off) and fills a shard from them, bucket by bucket, cast to into's dtype:
// the optimizer's model-dtype shard, or at stage 3 the parameter shard.
// pool lends the bucket buffers.
func loadShard(ld loadSpec, pool *bufferPool, into Tensor) error {
	s, rank := ld.s, ld.comm.Rank()
	bcast := ld.broadcast && ld.comm.Size() > 1
	for b, bp := range ld.plan.Buckets {
		buf, err := pool.get(ld.plan.MaxBucket())
		if err != nil {
			return err
		}
		t := buf.t.slice(0, bp.Padded)
		segs := bucketSegments(ld.plan, ld.params, b, nil)
		err = s.Wait(buf.free)
		if err == nil {
			err = ld.dev.zero(s, t)
		}
		if err == nil {
			err = ld.dev.flatten(s, t, segs, 1)
		}
		if err == nil && bcast {
			if err = ld.comm.Broadcast(s, t, 0); err == nil && rank != 0 {
				err = ld.dev.unflatten(s, t, segs)
			}
		}
		if err == nil {
			err = ld.dev.cast(s, into.slice(bp.ShardOffset, bp.Shard), t.slice(rank*bp.Shard, bp.Shard), 1)
		}
		var done Event
		if err == nil {
			done, err = record(s)
		}
		if done == nil { // failed: the work queued on buf may still run
			done = fence(s)
		}
		pool.put(buf, done)
		if err != nil {
			return err
		}
	}
	if bcast { // frozen parameters have no bucket: one broadcast each
		for _, p := range ld.params {
			if p.Frozen && p.Data.count > 0 {
				if err := ld.comm.Broadcast(s, p.Data, 0); err != nil {
					return err
				}
			}
		}
	}
	return s.Sync()
}

// newParamState fills the stage-3 parameter shard: from the parameters'
// memory (rank 0's, unless NoBroadcast) and from the initialisers of a
// sharded build, each called for this rank's ranges only. gs is the gather
// stream; ld.s the stream the step updates the shard on. host, when not
// nil, holds the shard in page-locked host memory (Offload.Params).
func newParamState(ld loadSpec, cfg ParamPolicy, gs Stream, host *hostMemory) (*paramState, error) {
	ps := &paramState{dev: ld.dev, comm: ld.comm, plan: ld.plan, params: ld.params, world: ld.comm.Size(), gs: gs, rs: ld.s, host: host,
		refs: make([]int, len(ld.params)), asked: make([]bool, len(ld.params)), buckets: make([]gathered, len(ld.plan.Buckets)),
		prefetchBytes: int64(cfg.PrefetchBytes), liveBytes: int64(cfg.LiveParamBytes)}
	ps.pool = newBufferPool(ps.dev, ps.plan.modelDType(), &ps.mem)
	s := ld.s
	var err error
	if host != nil { // page-locked memory comes zeroed
		if ps.shard, err = host.Alloc(ps.plan.ShardElems, ps.plan.modelDType()); err != nil {
			return ps, err
		}
	} else {
		if ps.shard, err = ps.dev.Alloc(ps.plan.ShardElems, ps.plan.modelDType()); err != nil {
			return ps, err
		}
		ps.mem.add(int64(ps.shard.Bytes()))
		if err := ps.dev.zero(s, ps.shard); err != nil {
			return ps, err
		}
	}
	if err := loadShard(ld, ps.pool, ps.shard); err != nil {
		return ps, err
	}
	rank := ld.comm.Rank()
	most := 0 // one buffer, of the largest range, serves every Init
	for i, p := range ps.params {
		if p.Init != nil && !p.Frozen {
			most = max(most, ps.plan.shardRange(i, rank).Count)
		}
	}
	buf := make([]float32, most)
	for i, p := range ps.params {
		if p.Init == nil || p.Frozen {
			continue
		}
		rg := ps.plan.shardRange(i, rank)
		if rg.Count == 0 {
			continue
		}
		host := buf[:rg.Count]
		if err := p.Init(host, rg.ParamOffset); err != nil {
			return ps, errorf(ErrParam, "Init of parameter %d (%q) at offset %d: %v", i, p.Name, rg.ParamOffset, err)
		}
		if err := ps.uploadCast(s, ps.shard.slice(rg.ShardOffset, rg.Count), host); err != nil {
			return ps, err
		}
	}
	return ps, s.Sync()
}

// sharedShard is the parameter shard, which the optimizer's pass writes.
func (ps *paramState) sharedShard() *Tensor { return &ps.shard }

// uploadCast writes host fp32 values into the shard, of any dtype: cast
// by the host where the shard is host memory, else through an fp32 copy on
// the device.
func (ps *paramState) uploadCast(s Stream, dst Tensor, host []float32) error {
	if ps.host != nil {
		hs := NewHostStream()
		err := hostDev.cast(hs, dst, Float32s(host), 1)
		return errors.Join(err, hs.Sync(), hs.Close())
	}
	tmp, err := ps.dev.Alloc(len(host), FP32)
	if err != nil {
		return err
	}
	err = ps.dev.copy(s, tmp, Float32s(host))
	if err == nil {
		err = ps.dev.cast(s, dst, tmp, 1)
	}
	if err == nil {
		err = s.Sync()
	}
	freeSynced(ps.dev, tmp, err == nil, s)
	return err
}

// check refuses op's stream and parameters before anything changes.
func (ps *paramState) check(op string, s Stream, list []int) error {
	if s == nil {
		return errorf(ErrStream, "%s with a nil stream; pass the stream that uses the parameters", op)
	}
	for _, p := range list {
		if p < 0 || p >= len(ps.params) {
			return errorf(ErrParam, "%s of parameter %d; registered parameters are 0..%d", op, p, len(ps.params)-1)
		}
		if ps.params[p].Frozen {
			return errorf(ErrParam, "%s of parameter %d (%q), which is frozen: it is not sharded; use its own memory", op, p, ps.params[p].Name)
		}
	}
	return nil
}

// unasked reports whether parameter p has a shard and no caller's Gather
// named it since the last Step.
func (ps *paramState) unasked(p int) bool {
	return ps.plan.ParamBucket[p] >= 0 && !ps.asked[p]
}

// gather is Gather: see there.
func (ps *paramState) gather(s Stream, list []int) ([]Tensor, error) {
	views := make([]Tensor, len(list))
	waited := -1 // the bucket s last waited for: members of a bucket come together
	for i, p := range list {
		b := ps.plan.ParamBucket[p]
		if b < 0 {
			views[i] = Tensor{dtype: ps.plan.modelDType()}
			continue
		}
		g := &ps.buckets[b]
		if g.refs == 0 { // asked for anew (a prefetched bucket has no reference yet)
			ps.followOrder(b)
			switch {
			case g.prefetched:
				ps.hits++
				g.prefetched = false
			case g.buf == nil:
				if ps.last != nil {
					ps.misses++
				}
				if err := ps.gatherBucket(b); err != nil {
					return nil, err
				}
			}
		}
		if b != waited {
			if err := s.Wait(g.ready); err != nil {
				return nil, err
			}
			waited = b
			if !slices.Contains(g.holders, s) {
				g.holders = append(g.holders, s)
			}
		}
		g.refs++
		ps.refs[p]++
		ps.asked[p] = true
		views[i] = g.buf.t.slice(ps.plan.ParamOffset[p], ps.params[p].Count)
	}
	return views, ps.prefetch()
}

// release is Release: see there. It refuses before anything changes.
func (ps *paramState) release(s Stream, list []int) (refused, err error) {
	for i, p := range list {
		want := 1 // references list hands back for p, up to this one
		for _, q := range list[:i] {
			if q == p {
				want++
			}
		}
		if ps.plan.ParamBucket[p] >= 0 && ps.refs[p] < want {
			return errorf(ErrProtocol, "Release of parameter %d (%q), which is not gathered (or released already); release what Gather returned, once", p, ps.params[p].Name), nil
		}
	}
	used, err := record(s)
	if err != nil {
		return nil, err
	}
	for _, p := range list {
		b := ps.plan.ParamBucket[p]
		if b < 0 {
			continue
		}
		g := &ps.buckets[b]
		ps.refs[p]--
		g.refs--
		g.users = append(g.users, used)
		if g.refs == 0 {
			if ps.usedSoon(b) { // keep it for its next use, as a prefetch would gather it
				g.prefetched = true
				continue
			}
			if err := ps.dropBucket(b); err != nil {
				return nil, err
			}
		}
	}
	return nil, nil
}

// memory is ParamMemory: see there.
func (ps *paramState) memory() ParamMemory {
	n := 0
	for _, g := range ps.buckets {
		if g.buf != nil {
			n++
		}
	}
	device, host := ps.shardBytes()
	return ParamMemory{ShardBytes: device, HostShardBytes: host, GatheredBytes: ps.gatheredBytes, PooledBytes: ps.pool.bytes,
		PeakBytes: ps.mem.peak, GatheredBuckets: n, Buffers: ps.pool.held}
}

// shardBytes is the shard's bytes on the device and on the host: one of
// them is zero.
func (ps *paramState) shardBytes() (device, host int64) {
	if ps.host != nil {
		return 0, int64(ps.shard.Bytes())
	}
	return int64(ps.shard.Bytes()), 0
}

// send is this rank's part of bucket bp as an all-gather into buf (the
// bucket's padded buffer, on the device) sends it, enqueued on s: the
// shard's own memory, or, where the shard is host memory, a copy of it into
// its place in buf, so the all-gather runs in place.
func (ps *paramState) send(s Stream, bp *BucketPlan, buf Tensor) (Tensor, error) {
	mine := ps.shard.slice(bp.ShardOffset, bp.Shard)
	if ps.host == nil {
		return mine, nil
	}
	slot := buf.slice(ps.comm.Rank()*bp.Shard, bp.Shard)
	return slot, ps.dev.copy(s, slot, mine)
}

// gatherBucket all-gathers bucket b from every rank's parameter shard into a
// pooled buffer on the gather stream.
func (ps *paramState) gatherBucket(b int) error {
	st, bp, s := ps, &ps.plan.Buckets[b], ps.gs
	buf, err := st.pool.get(ps.plan.MaxBucket())
	if err != nil {
		return err
	}
	g := &st.buckets[b]
	var start, ready, end Event
	err = s.Wait(buf.free)
	if err == nil {
		start, err = st.times.mark(s)
	}
	var send Tensor
	if err == nil {
		send, err = ps.send(s, bp, buf.t)
	}
	if err == nil {
		err = ps.comm.AllGather(s, send, buf.t.slice(0, bp.Padded))
	}
	if err == nil {
		ps.sent.add(KindAllGather, bp.Padded*ps.plan.modelDType().Size(), ps.world)
		ready, err = record(s)
	}
	if err == nil {
		end, err = st.times.mark(s)
	}
	if err != nil {
		st.times.release(start)
		st.pool.put(buf, fence(s))
		return err
	}
	st.times.add(start, end)
	g.buf, g.ready, g.users = buf, ready, g.users[:0]
	st.gatheredBytes += int64(buf.t.Bytes())
	return nil
}

// dropBucket returns bucket b's buffer to the pool, free once the gather
// and every stream that released it are done with it.
func (ps *paramState) dropBucket(b int) error {
	st, s := ps, ps.gs
	g := &st.buckets[b]
	for _, u := range g.users {
		if err := s.Wait(u); err != nil {
			return err
		}
	}
	free, err := record(s)
	if err != nil {
		free = fence(s)
	}
	st.pool.put(g.buf, free)
	st.gatheredBytes -= int64(g.buf.t.Bytes())
	*g = gathered{users: g.users[:0], holders: g.holders[:0]}
	return err
}

// followOrder notes that bucket b was asked for: this window's order, and
// the place in the last window's order to prefetch from.
func (ps *paramState) followOrder(b int) {
	st := ps
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
func (ps *paramState) usedSoon(b int) bool {
	st := ps
	if st.prefetchBytes <= 0 {
		return false
	}
	size := int64(ps.plan.MaxBucket() * ps.plan.modelDType().Size())
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
func (ps *paramState) prefetch() error {
	st := ps
	if st.prefetchBytes <= 0 {
		return nil
	}
	ahead, size := int64(0), int64(ps.plan.MaxBucket()*ps.plan.modelDType().Size())
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
		if err := ps.gatherBucket(b); err != nil {
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
func (ps *paramState) endWindow() error {
	st := ps
	for b := range st.buckets {
		if st.buckets[b].prefetched {
			st.wasted++
			if err := ps.dropBucket(b); err != nil {
				return err
			}
		}
	}
	ev, err := record(ps.gs)
	if err == nil {
		err = ps.rs.Wait(ev)
	}
	st.last, st.order, st.cursor = append(st.last[:0], st.order...), st.order[:0], 0
	clear(st.asked)
	return err
}

// stillGathered counts the parameter references not yet released.
func (ps *paramState) stillGathered() int {
	n := 0
	for _, r := range ps.refs {
		n += r
	}
	return n
}

// close waits for the gathers and the users of gathered buffers, and frees
// the parameter memory.
func (st *paramState) close() error {
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
		if g.refs > 0 { // views still out: their streams may still read them
			for _, h := range g.holders {
				h.Sync() // the caller's stream: its errors are the caller's
			}
		}
		st.pool.put(g.buf, nil)
		g.buf = nil
	}
	errs = append(errs, st.pool.trim(0))
	if st.shard.ptr != 0 && st.host != nil {
		errs = append(errs, st.host.Free(st.shard))
		st.shard = Tensor{}
	}
	if st.shard.ptr != 0 {
		errs = append(errs, st.dev.Free(st.shard))
		st.shard = Tensor{}
	}
	return errors.Join(errs...)
}

// readParams returns the current value of every parameter with memory in
// fp32 (FullParams): from Param.Data, or at stage 3 (ps not nil)
// all-gathered from the parameter shards, bucket by bucket, on s once rs's
// work (the last step's writes into the shard) is done.
func readParams(dev Device, s, rs Stream, plan *Plan, params []Param, ps *paramState) ([][]float32, error) {
	out := make([][]float32, len(params))
	wide, err := dev.Alloc(max(plan.MaxBucket(), maxCount(params)), FP32)
	if err != nil {
		return nil, err
	}
	defer freeAfter(dev, wide, s)
	read := func(src Tensor) ([]float32, error) { // any dtype, on the device, to host fp32
		host := make([]float32, src.count)
		err := dev.cast(s, wide.slice(0, src.count), src, 1)
		if err == nil {
			err = dev.copy(s, Float32s(host), wide.slice(0, src.count))
		}
		if err == nil {
			err = s.Sync()
		}
		return host, err
	}
	for p, q := range params { // at stage 3 only the frozen ones keep their own memory
		if q.Data.count > 0 && (ps == nil || q.Frozen) {
			if out[p], err = read(q.Data); err != nil {
				return nil, err
			}
		}
	}
	if ps == nil {
		return out, nil
	}
	ev, err := record(rs)
	if err == nil {
		err = s.Wait(ev)
	}
	if err != nil {
		return nil, err
	}
	buf, err := dev.Alloc(plan.MaxBucket(), plan.modelDType())
	if err != nil {
		return nil, err
	}
	defer freeAfter(dev, buf, s)
	for b := range plan.Buckets {
		bp := &plan.Buckets[b]
		t := buf.slice(0, bp.Padded)
		send, err := ps.send(s, bp, t)
		if err != nil {
			return nil, err
		}
		if err := ps.comm.AllGather(s, send, t); err != nil {
			return nil, err
		}
		flat, err := read(t)
		if err != nil {
			return nil, err
		}
		for _, p := range bp.Params {
			off := plan.ParamOffset[p]
			out[p] = append([]float32(nil), flat[off:off+params[p].Count]...)
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

// report fills the step's parameter figures and the window's gathers, and
// starts the next window's.
func (ps *paramState) report(st *Stats) error {
	st.Collectives = st.Collectives.Add(ps.sent)
	ps.sent = CommCounters{}
	device, host := ps.shardBytes()
	st.ParamShardBytes, st.PeakParamBytes, st.GatherBuffers = device, ps.mem.peak, ps.pool.held
	st.HostParamBytes = host
	st.DeviceBytesSaved += host
	st.PrefetchHits, st.PrefetchMisses, st.PrefetchWasted = ps.hits, ps.misses, ps.wasted
	ps.hits, ps.misses, ps.wasted = 0, 0, 0
	ps.mem.peak = ps.mem.cur
	var err error
	st.ParamGatherTime, err = ps.times.take()
	return err
}

// afterStep starts the next window: its first buckets prefetched from the
// updated shard, once the step's writes on rs are done.
func (ps *paramState) afterStep() error {
	ev, err := record(ps.rs)
	if err == nil {
		err = ps.gs.Wait(ev)
	}
	if err == nil {
		err = ps.prefetch()
	}
	return err
}

// dropGathered gives back every gathered bucket before the shard is
// overwritten (a checkpoint's load; nothing may be held): the gathers wait
// for nothing more, and the next ones read the new shard.
func (ps *paramState) dropGathered() error {
	for b := range ps.buckets {
		if ps.buckets[b].buf != nil {
			if err := ps.dropBucket(b); err != nil {
				return err
			}
		}
	}
	ev, err := record(ps.gs)
	if err == nil {
		err = ps.rs.Wait(ev) // the shard's new values are written after the gathers' reads
	}
	return err
}

// paramsSize is what stage 3's parameters hold at their peak: the shard in
// the model dtype (in page-locked host memory with Offload.Params, onHost)
// and the gather buffers (gatherBuffers) of one largest bucket each, when
// the framework gathers the sets at once.
func paramsSize(plan *Plan, params []Param, pp ParamPolicy, sets [][]int, onHost bool) (DeviceBytes, HostBytes) {
	msize := int64(plan.modelDType().Size())
	shard, buf := int64(plan.ShardElems)*msize, int64(plan.MaxBucket())*msize
	d := DeviceBytes{Gathered: gatherBuffers(plan, params, pp, sets, buf) * buf}
	if onHost {
		return d, HostBytes{ParamShard: shard}
	}
	d.ParamShard = shard
	return d, HostBytes{}
}

// gatherBuffers is how many gather buffers a stage-3 engine holds at its
// peak: the most buckets one set of run's gathers spans, plus the buckets
// the prefetch gathers ahead (PrefetchBytes' worth, at least one), within
// LiveParamBytes, which caps the prefetch only. size is a buffer's bytes.
func gatherBuffers(plan *Plan, params []Param, pp ParamPolicy, sets [][]int, size int64) int64 {
	held := int64(1) // loading the shard at New takes one
	if sets == nil {
		sets = [][]int{{}}
	}
	for _, set := range sets {
		seen := map[int]bool{}
		for _, p := range set {
			if b := plan.ParamBucket[p]; b >= 0 {
				seen[b] = true
			}
		}
		held = max(held, int64(len(seen)))
	}
	if pp.PrefetchBytes <= 0 || size == 0 {
		return held
	}
	ahead := max(1, int64(pp.PrefetchBytes)/size)
	if pp.LiveParamBytes > 0 {
		ahead = max(0, min(ahead, int64(pp.LiveParamBytes)/size-held))
	}
	return held + ahead
}
