package zero

import "errors"

// The gradient shard's sum of squares, for Step's global norm. It is formed
// per chunk of normChunk elements of each bucket's part of the shard, the
// chunks of a bucket added in the device's fixed order (sumChunks), the
// buckets in bucket order. A landing that knows it is the last of the step
// sums the chunks it stored while they are in cache (accumulateSquares);
// Step reads the shard again only for the buckets whose last landing did
// not. A chunk's sum depends only on its values, so the norm has the same
// bits whichever way its chunks were summed.

// shardNorm keeps the chunk sums of a sink's shard, and which buckets' sums
// are those of the shard as it stands.
type shardNorm struct {
	dev    Device    // where the sums are added
	mem    allocator // where they live: dev, or the offload's host memory
	plan   *Plan
	parts  Tensor       // chunk sums (float64s, two fp32 words each), the buckets' chunks in bucket order
	outs   Tensor       // per bucket, the sum of its chunks
	ranges []chunkRange // per bucket, its chunks in parts
	fresh  []bool       // per bucket: its last landing summed its chunks
	host   []float32    // outs, read back
}

func newShardNorm(dev Device, mem allocator, plan *Plan) (*shardNorm, error) {
	n := &shardNorm{dev: dev, mem: mem, plan: plan, ranges: make([]chunkRange, len(plan.Buckets)), fresh: make([]bool, len(plan.Buckets))}
	at := 0
	for b, bp := range plan.Buckets {
		n.ranges[b] = chunkRange{at, at + chunksOf(bp.Shard)}
		at = n.ranges[b].hi
	}
	n.host = make([]float32, 2*len(plan.Buckets))
	var err error
	if n.parts, err = mem.Alloc(2*at, FP32); err != nil {
		return n, err
	}
	n.outs, err = mem.Alloc(2*len(plan.Buckets), FP32)
	return n, err
}

// normSumsBytes is what newShardNorm allocates for plan.
func normSumsBytes(plan *Plan) int64 {
	chunks := 0
	for _, bp := range plan.Buckets {
		chunks += chunksOf(bp.Shard)
	}
	return 8 * int64(chunks+len(plan.Buckets))
}

// bytes is the memory the sums take (0 without them).
func (n *shardNorm) bytes() int64 {
	if n == nil {
		return 0
	}
	return int64(n.parts.Bytes() + n.outs.Bytes())
}

// partsOf is where bucket b's chunk sums go.
func (n *shardNorm) partsOf(b int) Tensor {
	r := n.ranges[b]
	return n.parts.slice(2*r.lo, 2*(r.hi-r.lo))
}

// landed records a landing into bucket b's part of the shard, which summed
// its chunks or not.
func (n *shardNorm) landed(b int, summed bool) {
	if n != nil {
		n.fresh[b] = summed
	}
}

// forget marks every bucket's sums as stale: a new window begins.
func (n *shardNorm) forget() {
	if n != nil {
		clear(n.fresh)
	}
}

// squares is the sum of squares of shard, on the device's stream s, once
// every landing has finished: the stale buckets' chunks summed from the
// shard (read counts their bytes), then every bucket's chunks added.
func (n *shardNorm) squares(s Stream, shard Tensor) (sumsq float64, read int64, err error) {
	if n == nil {
		return 0, 0, errorf(ErrProtocol, "the norm of a shard without an optimizer")
	}
	for b, bp := range n.plan.Buckets {
		if n.fresh[b] {
			continue
		}
		part := shard.slice(bp.ShardOffset, bp.Shard)
		if err := n.dev.chunkSquares(s, part, n.partsOf(b)); err != nil {
			return 0, read, err
		}
		read += int64(part.Bytes())
	}
	if err := n.dev.sumChunks(s, n.parts, n.ranges, n.outs); err != nil {
		return 0, read, err
	}
	if err := n.dev.copy(s, Float32s(n.host), n.outs); err != nil {
		return 0, read, err
	}
	if err := s.Sync(); err != nil {
		return 0, read, err
	}
	for _, x := range float64s(Float32s(n.host)) {
		sumsq += x
	}
	return sumsq, read, nil
}

func (n *shardNorm) close() error {
	if n == nil {
		return nil
	}
	return errors.Join(n.mem.Free(n.parts), n.mem.Free(n.outs))
}
