package zero

import (
	"math/rand"
	"testing"
)

// Tests of the partition plan (bucket.go): buckets, shards and offsets, and
// the layout fingerprint; and paramAt, which reads a plan back.

// TestPlanInvariants: on random parameter lists, every non-empty parameter
// lands in exactly one bucket, in reverse registration order; a bucket
// exceeds BucketBytes only when it holds one parameter; buckets split into
// W equal shards of whole Align units; offsets tile the flat layout.
func TestPlanInvariants(t *testing.T) {
	rng := rand.New(rand.NewSource(testSeed(t)))
	for range 300 {
		world, align := 1+rng.Intn(8), 1+rng.Intn(64)
		d := []DType{FP32, BF16, FP16}[rng.Intn(3)]
		params := make([]Param, 1+rng.Intn(40))
		for i := range params {
			params[i] = Param{Count: rng.Intn(3000), DType: d}
			if rng.Intn(8) == 0 {
				params[i].Count = 0
			}
		}
		bucketBytes := 1 + rng.Intn(8000)
		p := newPlan(params, bucketBytes, world, align)
		seen := make([]int, len(params))
		flat, shard, prev := 0, 0, len(params)
		for b, bp := range p.Buckets {
			if bp.FlatOffset != flat || bp.ShardOffset != shard {
				t.Fatalf("bucket %d at flat %d shard %d, want %d and %d", b, bp.FlatOffset, bp.ShardOffset, flat, shard)
			}
			if bp.Padded%(world*align) != 0 || bp.Shard*world != bp.Padded || bp.Padded < bp.Elems || bp.Padded-bp.Elems >= world*align {
				t.Fatalf("bucket %d: %d elements padded to %d (shard %d) for W=%d align=%d", b, bp.Elems, bp.Padded, bp.Shard, world, align)
			}
			if bp.Elems*d.Size() > bucketBytes && len(bp.Params) != 1 {
				t.Fatalf("bucket %d holds %d bytes in %d parameters, over %d", b, bp.Elems*d.Size(), len(bp.Params), bucketBytes)
			}
			off := 0 // the end of the previous member
			for _, q := range bp.Params {
				if q >= prev {
					t.Fatalf("parameter %d after %d: not reverse registration order", q, prev)
				}
				prev = q
				seen[q]++
				// each member starts at the first 16-byte boundary after the last
				at := (off*d.Size() + 15) / 16 * 16 / d.Size()
				if p.ParamBucket[q] != b || p.ParamOffset[q] != at {
					t.Fatalf("parameter %d placed at bucket %d offset %d, listed in bucket %d at %d", q, p.ParamBucket[q], p.ParamOffset[q], b, at)
				}
				off = at + params[q].Count
			}
			if off != bp.Elems {
				t.Fatalf("bucket %d: members end at %d, Elems %d", b, off, bp.Elems)
			}
			flat += bp.Padded
			shard += bp.Shard
		}
		if flat != p.FullElems || shard != p.ShardElems {
			t.Fatalf("totals %d/%d, plan says %d/%d", flat, shard, p.FullElems, p.ShardElems)
		}
		for q, n := range seen {
			if want := min(params[q].Count, 1); n != want || (want == 0 && p.ParamBucket[q] != -1) {
				t.Fatalf("parameter %d (%d elements) in %d buckets", q, params[q].Count, n)
			}
		}
	}
}

// TestPlanFingerprint: the layout fingerprint is the same for every world
// size and Align, and changes with the layout.
func TestPlanFingerprint(t *testing.T) {
	params := testParams(BF16)
	base := newPlan(params, 512, 1, 64).Fingerprint()
	for world := 1; world <= 8; world++ {
		for _, align := range []int{1, 8, 64} {
			if got := newPlan(params, 512, world, align).Fingerprint(); got != base {
				t.Errorf("W=%d Align=%d: fingerprint %016x, W=1 Align=64 gave %016x", world, align, got, base)
			}
		}
	}
	other := append([]Param(nil), params...)
	other[2].Count++
	for name, p := range map[string]*Plan{
		"another bucket size": newPlan(params, 4096, 4, 64),
		"another count":       newPlan(other, 512, 4, 64),
		"another dtype":       newPlan(testParams(FP16), 512, 4, 64),
	} {
		if p.Fingerprint() == base {
			t.Errorf("%s: the same fingerprint", name)
		}
	}
}

// paramAt maps element flat of bucket b to (param, index), or −1 for padding.
func paramAt(plan *Plan, params []Param, b, flat int) (int, int) {
	for _, p := range plan.Buckets[b].Params {
		off := plan.ParamOffset[p]
		if flat >= off && flat < off+params[p].Count {
			return p, flat - off
		}
	}
	return -1, 0
}
