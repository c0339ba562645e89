package zero

import (
	"encoding/binary"
	"hash/fnv"
	"math"
)

// Plan is the partition plan: which bucket holds each parameter, where, and
// which elements each rank owns. It is the same on every rank.
type Plan struct {
	World   int          // ranks the buckets are split across
	Align   int          // shard sizes are multiples of Align elements
	Buckets []BucketPlan // in backward order: bucket 0 fills first

	// ParamBucket and ParamOffset place parameter p at ParamOffset[p] in
	// bucket ParamBucket[p] (−1 for a parameter of zero elements).
	ParamBucket []int
	ParamOffset []int // see ParamBucket
	ShardElems  int   // elements of one rank's shard over all buckets
	FullElems   int   // elements of all buckets, padding included
	counts      []int
}

// ShardRange is the part of one parameter that one rank's shard holds:
// elements [ParamOffset, ParamOffset+Count) of the parameter sit at
// [ShardOffset, ShardOffset+Count) of the shard. A parameter is contiguous
// in its bucket and a rank owns one contiguous slice of every bucket, so
// the part is a single range; Count is 0 where the rank holds none of it.
type ShardRange struct {
	ParamOffset int // first element of the parameter in the range
	ShardOffset int // where that element sits in the rank's shard
	Count       int // elements in the range
}

// ShardRange returns where rank's shard holds parameter param.
func (p *Plan) ShardRange(param, rank int) (ShardRange, error) {
	if param < 0 || param >= len(p.counts) {
		return ShardRange{}, errorf(ErrParam, "ShardRange: parameter %d; registered parameters are 0..%d", param, len(p.counts)-1)
	}
	if rank < 0 || rank >= p.World {
		return ShardRange{}, errorf(ErrConfig, "ShardRange: rank %d; ranks are 0..%d", rank, p.World-1)
	}
	return p.shardRange(param, rank), nil
}

func (p *Plan) shardRange(param, rank int) ShardRange {
	b := p.ParamBucket[param]
	if b < 0 {
		return ShardRange{}
	}
	bp := &p.Buckets[b]
	first, owned := p.ParamOffset[param], rank*bp.Shard
	lo, hi := max(first, owned), min(first+p.counts[param], owned+bp.Shard)
	if hi <= lo {
		return ShardRange{}
	}
	return ShardRange{ParamOffset: lo - first, ShardOffset: bp.ShardOffset + lo - owned, Count: hi - lo}
}

// BucketPlan is one bucket: members in backward order (the reverse of
// registration), padded so that it splits evenly into World shards.
type BucketPlan struct {
	Params      []int // member parameters, in the order they sit in the bucket
	Elems       int   // sum of the members' counts
	Padded      int   // Elems rounded up to a multiple of World·Align
	Shard       int   // Padded / World: the elements each rank owns
	ShardOffset int   // where this bucket's shard sits in a rank's shard buffer
	FlatOffset  int   // where this bucket sits in the full flat layout
}

// newPlan cuts buckets of at most bucketBytes of model-dtype gradient from
// the parameters in reverse registration order. A parameter larger than a
// bucket gets a bucket of its own.
func newPlan(params []Param, bucketBytes, world, align int) *Plan {
	p := &Plan{World: world, Align: align, ParamBucket: make([]int, len(params)), ParamOffset: make([]int, len(params)), counts: make([]int, len(params))}
	for i, q := range params {
		p.counts[i] = q.Count
	}
	var cur BucketPlan
	curBytes := 0
	closeBucket := func() {
		if len(cur.Params) == 0 {
			return
		}
		unit := world * align
		cur.Padded = (cur.Elems + unit - 1) / unit * unit
		cur.Shard = cur.Padded / world
		cur.ShardOffset = p.ShardElems
		cur.FlatOffset = p.FullElems
		p.ShardElems += cur.Shard
		p.FullElems += cur.Padded
		p.Buckets = append(p.Buckets, cur)
		cur, curBytes = BucketPlan{}, 0
	}
	for i := len(params) - 1; i >= 0; i-- {
		n := params[i].Count
		if n == 0 {
			p.ParamBucket[i], p.ParamOffset[i] = -1, 0
			continue
		}
		bytes := n * params[i].DType.Size()
		if curBytes > 0 && curBytes+bytes > bucketBytes {
			closeBucket()
		}
		p.ParamBucket[i], p.ParamOffset[i] = len(p.Buckets), cur.Elems
		cur.Params = append(cur.Params, i)
		cur.Elems += n
		curBytes += bytes
		if curBytes >= bucketBytes {
			closeBucket()
		}
	}
	closeBucket()
	return p
}

// MaxBucket returns the padded size of the largest bucket.
func (p *Plan) MaxBucket() int {
	m := 0
	for _, b := range p.Buckets {
		m = max(m, b.Padded)
	}
	return m
}

// hash fingerprints the plan and the settings every rank must share.
func (p *Plan) hash(cfg *Config, params []Param) uint64 {
	h := fnv.New64a()
	put := func(v int64) {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], uint64(v))
		h.Write(b[:])
	}
	put(int64(p.World))
	put(int64(p.Align))
	put(int64(cfg.Stage))
	put(int64(cfg.BucketBytes))
	put(int64(cfg.Reduction))
	put(int64(cfg.CommDType))
	put(int64(cfg.GradAccumSteps))
	put(int64(math.Float64bits(cfg.PredivideFactor)))
	for _, q := range params {
		put(int64(q.Count))
		put(int64(q.DType))
	}
	for _, b := range p.Buckets {
		put(int64(b.Padded))
		for _, m := range b.Params {
			put(int64(m))
		}
	}
	return h.Sum64()
}

// staging is a bucket-sized buffer of the communication dtype. free fires
// when the last reduction that used it has finished with it.
type staging struct {
	buf  Tensor
	free Event
}

// stagingPool hands out bucket buffers first-freed-first, so two buffers
// ping-pong: the next bucket fills one while the other is reduced. It grows
// when the arrival order keeps more buckets open than it holds.
type stagingPool struct {
	dev   Device
	elems int
	dtype DType
	idle  []*staging
	size  int // buffers allocated
	mem   *memoryMeter
}

func (sp *stagingPool) get() (*staging, error) {
	if len(sp.idle) == 0 {
		if err := sp.grow(1); err != nil {
			return nil, err
		}
	}
	s := sp.idle[0]
	sp.idle = sp.idle[1:]
	return s, nil
}

// grow adds n idle buffers.
func (sp *stagingPool) grow(n int) error {
	for range n {
		t, err := sp.dev.Alloc(sp.elems, sp.dtype)
		if err != nil {
			return err
		}
		sp.size++
		sp.mem.add(int64(t.Bytes()))
		sp.idle = append(sp.idle, &staging{buf: t})
	}
	return nil
}

func (sp *stagingPool) put(s *staging, free Event) {
	s.free = free
	sp.idle = append(sp.idle, s)
}

// release frees every idle buffer.
func (sp *stagingPool) release() error { return sp.trim(0) }

// trim frees idle buffers, the longest idle first, until the pool holds
// keep buffers or none is idle. A buffer is freed only after the last
// reduction that read it has finished.
func (sp *stagingPool) trim(keep int) error {
	var first error
	for sp.size > keep && len(sp.idle) > 0 {
		s := sp.idle[0]
		sp.idle = sp.idle[1:]
		if s.free != nil {
			if err := s.free.Sync(); err != nil && first == nil {
				first = err
			}
		}
		sp.mem.add(-int64(s.buf.Bytes()))
		if err := sp.dev.Free(s.buf); err != nil && first == nil {
			first = err
		}
		sp.size--
	}
	return first
}

// memoryMeter tracks the bytes of gradient memory held and their peak.
type memoryMeter struct {
	cur, peak int64
}

func (m *memoryMeter) add(n int64) {
	m.cur += n
	m.peak = max(m.peak, m.cur)
}
