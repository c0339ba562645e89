package zero

import (
	"encoding/binary"
	"hash/fnv"
	"math"
)

// Plan is the partition plan: which bucket holds each parameter, where, and
// which elements each rank owns. It is the same on every rank.
type Plan struct {
	World   int
	Align   int // shard sizes are multiples of Align elements
	Buckets []BucketPlan
	// ParamBucket and ParamOffset place parameter p at ParamOffset[p] in
	// bucket ParamBucket[p] (−1 for a parameter of zero elements).
	ParamBucket []int
	ParamOffset []int
	ShardElems  int // elements of one rank's shard over all buckets
	FullElems   int // elements of all buckets, padding included
}

// BucketPlan is one bucket: members in backward order (the reverse of
// registration), padded so that it splits evenly into World shards.
type BucketPlan struct {
	Params      []int
	Elems       int // sum of the members' counts
	Padded      int // Elems rounded up to a multiple of World·Align
	Shard       int // Padded / World: the elements each rank owns
	ShardOffset int // where this bucket's shard sits in a rank's shard buffer
	FlatOffset  int // where this bucket sits in the full flat layout
}

// newPlan cuts buckets of at most bucketBytes of model-dtype gradient from
// the parameters in reverse registration order. A parameter larger than a
// bucket gets a bucket of its own.
func newPlan(params []Param, bucketBytes, world, align int) *Plan {
	p := &Plan{World: world, Align: align, ParamBucket: make([]int, len(params)), ParamOffset: make([]int, len(params))}
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

func (sp *stagingPool) release() {
	for _, s := range sp.idle {
		if s.free != nil {
			_ = s.free.Sync()
		}
		sp.mem.add(-int64(s.buf.Bytes()))
		_ = sp.dev.Free(s.buf)
	}
	sp.idle, sp.size = nil, 0
}

// memoryMeter tracks the bytes of gradient memory held and their peak.
type memoryMeter struct {
	cur, peak int64
}

func (m *memoryMeter) add(n int64) {
	m.cur += n
	m.peak = max(m.peak, m.cur)
}
