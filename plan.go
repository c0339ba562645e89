package zero

// The partition plan, the only owner of layout.

// Plan is the partition plan: which bucket holds each parameter, where, and
// which elements each rank owns. It is the same on every rank.
type Plan struct {
	World   int          // ranks the buckets are split across
	Align   int          // shard sizes are multiples of Align elements
	Buckets []BucketPlan // in backward order: bucket 0 fills first

	// ParamBucket and ParamOffset place parameter p at ParamOffset[p] in
	// bucket ParamBucket[p] (−1 for a parameter of zero elements or a
	// frozen one).
	ParamBucket []int
	ParamOffset []int // see ParamBucket
	ShardElems  int   // elements of one rank's shard over all buckets
	FullElems   int   // elements of all buckets, padding included
	counts      []int
	dtype       DType // of the gradients
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
// registration), each starting on a 16-byte boundary so every gradient can
// take the kernels' vector path, padded so that it splits evenly into World
// shards.
type BucketPlan struct {
	Params      []int // member parameters, in the order they sit in the bucket
	Elems       int   // the end of the last member: counts plus alignment gaps
	Padded      int   // Elems rounded up to a multiple of World·Align
	Shard       int   // Padded / World: the elements each rank owns
	ShardOffset int   // where this bucket's shard sits in a rank's shard buffer
	FlatOffset  int   // where this bucket sits in the full flat layout
}

// memberAlign is the alignment of members in a bucket, in elements of d:
// 16 bytes, the width of the kernels' vector loads.
func memberAlign(d DType) int { return 16 / d.Size() }

// newPlan cuts buckets of at most bucketBytes of model-dtype gradient from
// the parameters in reverse registration order. A parameter larger than a
// bucket gets a bucket of its own.
func newPlan(params []Param, bucketBytes, world, align int) *Plan {
	p := &Plan{World: world, Align: align, ParamBucket: make([]int, len(params)), ParamOffset: make([]int, len(params)), counts: make([]int, len(params))}
	for i, q := range params {
		p.counts[i] = q.Count
		p.dtype = q.DType
		if q.Frozen {
			p.counts[i] = 0 // no gradient, no elements in any bucket
		}
	}
	var cur BucketPlan
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
		cur = BucketPlan{}
	}
	for i := len(params) - 1; i >= 0; i-- {
		n, size := params[i].Count, params[i].DType.Size()
		if n == 0 || params[i].Frozen {
			p.ParamBucket[i], p.ParamOffset[i] = -1, 0
			continue
		}
		a := memberAlign(params[i].DType)
		at := (cur.Elems + a - 1) / a * a
		if len(cur.Params) > 0 && (at+n)*size > bucketBytes {
			closeBucket()
			at = 0
		}
		p.ParamBucket[i], p.ParamOffset[i] = len(p.Buckets), at
		cur.Params = append(cur.Params, i)
		cur.Elems = at + n
		if cur.Elems*size >= bucketBytes {
			closeBucket()
		}
	}
	closeBucket()
	return p
}

// bucketSegments lays out the members of bucket b that have memory, and
// that are used where used is given, as segments of the bucket's flat
// layout.
func bucketSegments(p *Plan, params []Param, b int, used []bool) []flatPiece {
	var segs []flatPiece
	for _, m := range p.Buckets[b].Params {
		if params[m].Data.count == 0 || (used != nil && !used[m]) {
			continue
		}
		segs = append(segs, flatPiece{Src: params[m].Data, Offset: p.ParamOffset[m]})
	}
	return segs
}

// modelDType is the gradients' dtype.
func (p *Plan) modelDType() DType { return p.dtype }

// elems is parameter param's elements in its bucket (0 for a frozen one).
func (p *Plan) elems(param int) int { return p.counts[param] }

// MaxBucket returns the padded size of the largest bucket.
func (p *Plan) MaxBucket() int {
	m := 0
	for _, b := range p.Buckets {
		m = max(m, b.Padded)
	}
	return m
}

// Fingerprint identifies the flat layout: which parameters (count and
// dtype) sit in which bucket at which offset. It does not depend on the
// world size or Align, which only pad and split the buckets, so a
// checkpoint written with one world size can be told apart from one of
// another layout when it is read with another.
func (p *Plan) Fingerprint() uint64 {
	h := newHasher()
	h.put(int64(p.dtype))
	h.put(int64(len(p.counts)))
	for _, n := range p.counts {
		h.put(int64(n))
	}
	for _, b := range p.Buckets {
		h.put(int64(len(b.Params)))
		for _, m := range b.Params {
			h.put(int64(m))
			h.put(int64(p.ParamOffset[m]))
		}
	}
	return h.sum()
}

// maxShardElems is the largest bucket shard of the plan.
func maxShardElems(p *Plan) int {
	n := 0
	for _, b := range p.Buckets {
		n = max(n, b.Shard)
	}
	return n
}
