//go:build cuda

package zero

import (
	"errors"
	"fmt"
	"math"
	mrand "math/rand"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// Tests of the CUDA path. Those that need a GPU skip with a message that
// names what is missing ("no CUDA device: …", "no libnccl.so.2: …"); the
// loader and error tests run everywhere. scripts/gpu-test.sh runs them on a
// GPU host, and the kernel tests again under compute-sanitizer.

// needNCCL loads NCCL or skips.
func needNCCL(t testing.TB) int {
	t.Helper()
	v, err := NCCLVersion("")
	if err != nil {
		skipOrFail(t, "no libnccl.so.2: %v", err)
	}
	return v
}

// ---- host/device buffers ------------------------------------------------------

// gbuf is the kernel tests' host buffer (tbuf, harness_test.go), with what
// the GPU tests add to it.
type gbuf = tbuf

func newGBuf(dt DType, n int) *gbuf { return newTBuf(dt, n) }

func (b *gbuf) isNaN(i int) bool {
	u := b.bits(i)
	switch b.dt {
	case FP32:
		return u&0x7f800000 == 0x7f800000 && u&0x7fffff != 0
	case BF16:
		return u&0x7f80 == 0x7f80 && u&0x7f != 0
	}
	return u&0x7c00 == 0x7c00 && u&0x3ff != 0
}

// fill draws data that exercises every path: half of the elements are any
// bit pattern (NaN payloads, infinities, subnormals, values that overflow a
// narrower dtype), the rest ordinary values around 1.
func (b *gbuf) fill(rng *rand.Rand, wild bool) {
	for i := 0; i < b.len(); i++ {
		v := float32(rng.NormFloat64() * math.Ldexp(1, rng.IntN(20)-10))
		switch {
		case b.dt == FP32 && wild && rng.IntN(2) == 0:
			b.f[i] = math.Float32frombits(rng.Uint32())
		case b.dt == FP32:
			b.f[i] = v
		case wild && rng.IntN(2) == 0:
			b.h[i] = uint16(rng.Uint32())
		case b.dt == BF16:
			b.h[i] = bf16FromFloat(v)
		default:
			b.h[i] = fp16FromFloat(v)
		}
	}
}

// sameAs compares bits; NaN matches any NaN (the GPU makes canonical NaNs
// where x86 keeps payloads, and elementwise.h does not promise payloads).
func (b *gbuf) sameAs(o *gbuf) (int, bool) {
	for i := 0; i < b.len(); i++ {
		if b.bits(i) != o.bits(i) && !(b.isNaN(i) && o.isNaN(i)) {
			return i, false
		}
	}
	return 0, true
}

// upload copies b into new device memory with pad elements before it, so
// the data can start at any alignment; it returns the tensor of b's data.
func upload(t testing.TB, d *cudaDevice, s Stream, b *gbuf, pad int) Tensor {
	t.Helper()
	whole, err := d.Alloc(b.len()+pad+1, b.dt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Free(whole) })
	dt := whole.slice(pad, b.len())
	if err := d.copy(s, dt, b.t()); err != nil {
		t.Fatal(err)
	}
	return dt
}

func download(t testing.TB, d *cudaDevice, s Stream, x Tensor) *gbuf {
	t.Helper()
	b := newGBuf(x.dtype, x.count)
	if err := d.copy(s, b.t(), x); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	return b
}

// gpuLayout is a batch of segments: host sources, device copies, offsets.
type gpuLayout struct {
	host  []*gbuf
	hsegs []segment
	dsegs []flatPiece
	total int
}

// makeGPULayout places nseg sources of random sizes in a flat buffer, with
// gaps; aligned layouts keep every offset and source 16-byte aligned (the
// vector path), the others misalign some.
func makeGPULayout(t testing.TB, rng *rand.Rand, d *cudaDevice, s Stream, dt DType, nseg, maxLen int, aligned bool) *gpuLayout {
	l := &gpuLayout{}
	off := 0
	for range nseg {
		n := rng.IntN(maxLen + 1)
		pad := 0
		if aligned {
			off = (off + 7) &^ 7
		} else {
			off += rng.IntN(3)
			pad = rng.IntN(8)
		}
		b := newGBuf(dt, n)
		b.fill(rng, true)
		dev := upload(t, d, s, b, pad)
		l.host = append(l.host, b)
		l.hsegs = append(l.hsegs, segment{ptr: b.t().ptr, count: int64(n), offset: int64(off)})
		l.dsegs = append(l.dsegs, flatPiece{Src: dev, Offset: off})
		off += n + rng.IntN(2)*rng.IntN(40)
	}
	l.total = off + 8
	rng.Shuffle(len(l.hsegs), func(i, j int) {
		l.hsegs[i], l.hsegs[j] = l.hsegs[j], l.hsegs[i]
		l.dsegs[i], l.dsegs[j] = l.dsegs[j], l.dsegs[i]
		l.host[i], l.host[j] = l.host[j], l.host[i]
	})
	return l
}

var gpuLayouts = []struct {
	name    string
	nseg    int
	maxLen  int
	aligned bool
}{
	{"one", 1, 70000, true},
	{"inline", 12, 9000, true},
	{"inline-misaligned", 20, 3000, false},
	{"ring", 150, 2000, true},
	{"ring-misaligned", 90, 500, false},
}

// ---- kernels: the same bits as the host C ------------------------------------------

func TestCUDAKernelsFlattenMatchHost(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	for _, lay := range gpuLayouts {
		for _, st := range allDTypes {
			l := makeGPULayout(t, rng, d, s, st, lay.nseg, lay.maxLen, lay.aligned)
			for _, dt := range allDTypes {
				for _, scale := range []float32{1, 0.125, 0.3, -3.75} {
					init := newGBuf(dt, l.total)
					init.fill(rng, false)
					want := init.clone()
					flattenHost(want.t().ptr, dt, l.hsegs, st, scale)
					dst := upload(t, d, s, init, 0)
					if err := d.flatten(s, dst, l.dsegs, scale); err != nil {
						t.Fatal(err)
					}
					got := download(t, d, s, dst)
					if i, ok := got.sameAs(want); !ok {
						t.Fatalf("flatten %s %v→%v scale %v: element %d = %#x, host %#x", lay.name, st, dt, scale, i, got.bits(i), want.bits(i))
					}
				}
			}
		}
	}
}

func TestCUDAKernelsAccumulateMatchHost(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	flagDev, err := d.Alloc(1, FP32)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(flagDev)
	for _, lay := range gpuLayouts {
		for _, st := range allDTypes {
			l := makeGPULayout(t, rng, d, s, st, lay.nseg, lay.maxLen, lay.aligned)
			for _, at := range allDTypes { // the accumulator: fp32, or 16 bits rounded once
				for _, first := range []bool{true, false} {
					for _, scale := range []float32{1, 0.5, -3.75} {
						init := newGBuf(at, l.total)
						init.fill(rng, false)
						want := init.clone()
						hostFlag := newGBuf(FP32, 1)
						accumulateHost(want.t().ptr, at, l.hsegs, st, first, scale, hostFlag.t().ptr)
						acc := upload(t, d, s, init, 0)
						if err := d.zero(s, flagDev); err != nil {
							t.Fatal(err)
						}
						if err := d.accumulate(s, acc, l.dsegs, first, scale, flagDev); err != nil {
							t.Fatal(err)
						}
						got := download(t, d, s, acc)
						if i, ok := got.sameAs(want); !ok {
							t.Fatalf("accumulate %s %v into %v first=%v scale %v: element %d = %#x, host %#x", lay.name, st, at,
								first, scale, i, got.bits(i), want.bits(i))
						}
						if gf := download(t, d, s, flagDev); gf.f[0] != hostFlag.f[0] {
							t.Fatalf("accumulate %s %v into %v: overflow flag %v, host %v", lay.name, st, at, gf.f[0], hostFlag.f[0])
						}
					}
				}
			}
		}
	}
}

// An fp16 accumulator's flag follows the stored value on the GPU as on the
// host: 65504 + 16 is finite in fp32 but rounds to inf.
func TestCUDAKernelsAccumulate16Overflow(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	for _, n := range []int{1, 7, 4096, 4099} {
		for _, c := range []struct {
			src  float32
			want bool
		}{{16, true}, {15, false}} {
			src, init := newGBuf(FP32, n), newGBuf(FP16, n)
			for i := range n {
				src.f[i] = 1
				init.set(i, 2)
			}
			src.f[n-1] = c.src
			init.set(n-1, 65504)
			flag := newGBuf(FP32, 1)
			dsrc, acc, dflag := upload(t, d, s, src, 0), upload(t, d, s, init, 0), upload(t, d, s, flag, 0)
			if err := d.accumulate(s, acc, []flatPiece{{Src: dsrc}}, false, 1, dflag); err != nil {
				t.Fatal(err)
			}
			got, gf := download(t, d, s, acc), download(t, d, s, dflag)
			if (gf.f[0] != 0) != c.want {
				t.Errorf("n %d: 65504 + %g: flag %v, want raised=%v", n, c.src, gf.f[0], c.want)
			}
			if wantBits := refEncode(FP16, 65504+c.src); got.bits(n-1) != wantBits || (n > 1 && got.bits(0) != refEncode(FP16, 3)) {
				t.Errorf("n %d: 65504 + %g stored %#x (element 0 %#x), want %#x", n, c.src, got.bits(n-1), got.bits(0), wantBits)
			}
		}
	}
}

func TestCUDAKernelsCastMatchHost(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	for _, n := range []int{1, 7, 8, 4099, 1 << 20} {
		for _, st := range allDTypes {
			src := newGBuf(st, n)
			src.fill(rng, true)
			for _, pad := range []int{0, 1} {
				dsrc := upload(t, d, s, src, pad)
				for _, dt := range allDTypes {
					for _, scale := range []float32{1, 0.3} {
						want := newGBuf(dt, n)
						castHost(want.t().ptr, dt, src.t().ptr, st, n, scale)
						dst := upload(t, d, s, newGBuf(dt, n), 0)
						if err := d.cast(s, dst, dsrc, scale); err != nil {
							t.Fatal(err)
						}
						got := download(t, d, s, dst)
						if i, ok := got.sameAs(want); !ok {
							t.Fatalf("cast n=%d pad=%d %v→%v scale %v: element %d = %#x, host %#x", n, pad, st, dt, scale, i, got.bits(i), want.bits(i))
						}
					}
				}
			}
		}
	}
}

func TestCUDAKernelsReduceMatchHost(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	for _, w := range []int{1, 2, 3, 4, 8} {
		for _, dt := range allDTypes {
			for _, chunk := range []int{1, 13, 64, 40000} {
				for _, op := range []ReduceOp{OpSum, OpAvg, OpMax} {
					host := make([]*gbuf, w)
					dev := make([]Tensor, w)
					for k := range w {
						host[k] = newGBuf(dt, w*chunk)
						host[k].fill(rng, true)
						dev[k] = upload(t, d, s, host[k], 0)
					}
					// reduce-scatter: output j = op over k of chunk j of src k,
					// written in place into chunk j of rank j's buffer
					want := make([]*gbuf, w)
					for j := range w {
						want[j] = newGBuf(dt, chunk)
						srcs := make([]uintptr, w)
						for k := range w {
							srcs[k] = host[k].t().ptr + uintptr(j*chunk*dt.Size())
						}
						reduceHost(want[j].t().ptr, srcs, dt, op, 0, chunk)
					}
					dsts := make([]uintptr, w)
					srcs := make([]uintptr, w)
					for k := range w {
						srcs[k] = dev[k].ptr
						dsts[k] = dev[k].slice(k*chunk, chunk).ptr
					}
					if err := d.reduce(s, dsts, srcs, dt, op, chunk); err != nil {
						t.Fatal(err)
					}
					for j := range w {
						got := download(t, d, s, dev[j].slice(j*chunk, chunk))
						if i, ok := got.sameAs(want[j]); !ok {
							t.Fatalf("reduce w=%d %v chunk %d %v: output %d element %d = %#x, host %#x", w, dt, chunk, op, j, i, got.bits(i), want[j].bits(i))
						}
					}
					// fused all-reduce over fresh buffers
					bufs := make([]uintptr, w)
					dbufs := make([]uintptr, w)
					for k := range w {
						host[k].fill(rng, true)
						dev[k] = upload(t, d, s, host[k], 0)
						bufs[k] = host[k].t().ptr
						dbufs[k] = dev[k].ptr
					}
					allReduceFusedHost(bufs, dt, op, 0, w*chunk)
					if err := d.allReduce(s, dbufs, dt, op, w*chunk); err != nil {
						t.Fatal(err)
					}
					for k := range w {
						got := download(t, d, s, dev[k])
						if i, ok := got.sameAs(host[k]); !ok {
							t.Fatalf("all-reduce w=%d %v n=%d %v: buffer %d element %d = %#x, host %#x", w, dt, w*chunk, op, k, i, got.bits(i), host[k].bits(i))
						}
					}
				}
			}
		}
	}
}

func TestCUDAKernelsSumSquares(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	for _, n := range []int{0, 1, 1000, 1 << 20, 3<<20 + 5} {
		x := newGBuf(FP32, n)
		x.fill(rng, false)
		want := sumSquaresHost(x.t().ptr, n)
		dx := upload(t, d, s, x, 0)
		var got, again float64
		if err := d.sumSquares(s, dx, &got); err != nil {
			t.Fatal(err)
		}
		if err := d.sumSquares(s, dx, &again); err != nil {
			t.Fatal(err)
		}
		if math.Float64bits(got) != math.Float64bits(again) {
			t.Fatalf("n=%d: sum of squares not deterministic: %v then %v", n, got, again)
		}
		if math.Abs(got-want) > 1e-12*math.Abs(want) {
			t.Fatalf("n=%d: sum of squares %v, host %v", n, got, want)
		}
	}
}

// ---- the norm's chunk sums of squares ---------------------------------------------

// TestCUDANormChunkIsTheKernelsBlock: block k of a one-segment accumulate
// launch writes the norm's chunk k only while the kernels' chunk is
// normChunk.
func TestCUDANormChunkIsTheKernelsBlock(t *testing.T) {
	if zcChunk != normChunk {
		t.Fatalf("ZC_CHUNK = %d elements, normChunk = %d: a landing's part[k] would not be chunk k", zcChunk, normChunk)
	}
}

// sumsSentinel fills the fp32 words of a sums buffer: a NaN (as fp32 words
// and as float64s) that no sum gives, to see what a kernel left untouched.
const sumsSentinel = 0x7ff4dead

func sentinelSums(n int) *gbuf {
	b := newGBuf(FP32, 2*n)
	for i := range b.f {
		b.f[i] = math.Float32frombits(sumsSentinel)
	}
	return b
}

// gammaSum is the relative error bound of a double sum of nonnegative terms
// that each pass through at most c additions (γ_c = c·u/(1−c·u), u = 2⁻⁵³),
// plus 4u for the reference's own error.
func gammaSum(c int) float64 {
	u := math.Ldexp(1, -53)
	return float64(c)*u/(1-float64(c)*u) + 4*u
}

// chunkAdds is the most additions a term goes through in a chunk's sum of
// m elements on the device: its thread's (every ZC_THREADS-th element,
// one add each) and the 8 levels of the tree over 256 threads.
func chunkAdds(m int) int { return (m+255)/256 + 8 }

// refChunkSums are the sums of squares of x's values per normChunk
// elements, float64(v)² (exact: 48 significant bits) added with Neumaier.
func refChunkSums(x *gbuf) []float64 {
	out := make([]float64, chunksOf(x.len()))
	for k := range out {
		lo, hi := k*normChunk, min((k+1)*normChunk, x.len())
		sq := make([]float64, 0, hi-lo)
		for i := lo; i < hi; i++ {
			v := float64(x.val(i))
			sq = append(sq, v*v)
		}
		out[k] = neumaier(sq)
	}
	return out
}

// TestCUDAKernelsAccumulateSquares: the landing with squares stores the
// bits (and raises the flag) the plain accumulate does; its chunk sums are
// chunkSquares' of the stored values bit for bit, nothing is written past
// the last chunk, and each sum is within gammaSum of a float64 reference.
// Every dtype pair, first or not, scale 1 or not, a 16-byte aligned
// segment and a misaligned one, sizes around the chunk.
func TestCUDAKernelsAccumulateSquares(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	flags := upload(t, d, s, newGBuf(FP32, 2), 0)
	for _, n := range []int{0, 1, 8191, 8192, 8193, 3*8192 + 5, 100003} {
		for _, aligned := range []bool{true, false} {
			pad, off := 0, 8
			if !aligned {
				pad, off = 3, 5
			}
			for _, st := range allDTypes {
				src := newGBuf(st, n)
				src.fill(rng, false)
				seg := flatPiece{Src: upload(t, d, s, src, pad), Offset: off}
				chunks := chunksOf(n)
				for _, at := range allDTypes {
					for _, first := range []bool{true, false} {
						for _, scale := range []float32{1, -3.75} {
							name := fmt.Sprintf("n=%d aligned=%v %v into %v first=%v scale=%v", n, aligned, st, at, first, scale)
							init := newGBuf(at, n+off+3)
							init.fill(rng, false)
							plain, with := upload(t, d, s, init, 0), upload(t, d, s, init, 0)
							parts := upload(t, d, s, sentinelSums(chunks+1), 0)
							again := upload(t, d, s, sentinelSums(chunks+1), 0)
							if err := d.zero(s, flags); err != nil {
								t.Fatal(err)
							}
							if err := d.accumulate(s, plain, []flatPiece{seg}, first, scale, flags.slice(0, 1)); err != nil {
								t.Fatal(err)
							}
							if err := d.accumulateSquares(s, with, seg, first, scale, flags.slice(1, 1), parts); err != nil {
								t.Fatalf("%s: %v", name, err)
							}
							gp, gw := download(t, d, s, plain), download(t, d, s, with)
							if i, ok := gw.sameAs(gp); !ok {
								t.Fatalf("%s: element %d stored %#x with squares, %#x without", name, i, gw.bits(i), gp.bits(i))
							}
							if gf := download(t, d, s, flags); gf.f[0] != gf.f[1] {
								t.Fatalf("%s: flag %v with squares, %v without", name, gf.f[1], gf.f[0])
							}
							if err := d.chunkSquares(s, with.slice(off, n), again); err != nil {
								t.Fatal(err)
							}
							gpart, gagain := download(t, d, s, parts), download(t, d, s, again)
							for i := range gpart.f {
								if gpart.bits(i) != gagain.bits(i) {
									t.Fatalf("%s: parts word %d (chunk %d of %d) = %#x, chunkSquares %#x", name, i, i/2, chunks, gpart.bits(i), gagain.bits(i))
								}
							}
							stored := newGBuf(at, n)
							for i := range n {
								stored.setBits(i, gw.bits(off+i))
							}
							got := float64s(gpart.t())
							for k, want := range refChunkSums(stored) {
								m := min(normChunk, n-k*normChunk)
								if !(math.Abs(got[k]-want) <= gammaSum(chunkAdds(m))*want) { // NaN fails too
									t.Fatalf("%s: chunk %d sum %v, float64 %v (bound %.2g relative)", name, k, got[k], want, gammaSum(chunkAdds(m)))
								}
							}
						}
					}
				}
			}
		}
	}
}

// TestCUDAKernelsChunkSquares: chunkSquares reads a 16-bit tensor as it is
// (no widened copy: the device's free memory does not move) and gives the
// bits it gives for the same values widened to fp32; the chunks' total
// through sumChunks is within its bound of a float64 reference and of
// sumSquares.
func TestCUDAKernelsChunkSquares(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	fake := os.Getenv("ZERO_FAKE_CUDA") == "1" // its free memory is exact
	// the descriptor ring sumChunks stages ranges in is the device's, taken once
	ring := upload(t, d, s, sentinelSums(2), 0)
	if err := d.sumChunks(s, ring, []chunkRange{{0, 1}}, ring.slice(2, 2)); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 3*8192 + 5, 300007} {
		for _, dt := range allDTypes {
			x := newGBuf(dt, n)
			x.fill(rng, false)
			chunks := chunksOf(n)
			dx := upload(t, d, s, x, 1)
			parts := upload(t, d, s, sentinelSums(chunks+1), 0)
			outs := upload(t, d, s, sentinelSums(2), 0)
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			free0, _, err := d.memInfo()
			if err != nil {
				t.Fatal(err)
			}
			// behind a busy stream, the calls neither wait for it nor hold
			// memory: a widened copy would have to do one or the other
			if err := cudaSpin(s, 300*time.Millisecond); err != nil {
				t.Fatal(err)
			}
			busy, err := s.Record()
			if err != nil {
				t.Fatal(err)
			}
			if err := d.chunkSquares(s, dx, parts); err != nil {
				t.Fatal(err)
			}
			if err := d.sumChunks(s, parts, []chunkRange{{0, chunks}}, outs); err != nil {
				t.Fatal(err)
			}
			if busy.Done() {
				t.Errorf("n=%d %v: chunkSquares+sumChunks returned after the stream's earlier work was done: they waited for it", n, dt)
			}
			if free1, _, _ := d.memInfo(); fake && free1 != free0 {
				t.Errorf("n=%d %v: free device memory %d before chunkSquares+sumChunks, %d after: a scratch was taken", n, dt, free0, free1)
			}
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			gpart := download(t, d, s, parts)
			if gpart.bits(2*chunks) != sumsSentinel || gpart.bits(2*chunks+1) != sumsSentinel {
				t.Errorf("n=%d %v: written past chunk %d", n, dt, chunks)
			}
			// the same values widened to fp32 (exactly): the same bits
			wide := newGBuf(FP32, n)
			for i := range n {
				wide.f[i] = x.val(i)
			}
			wparts := upload(t, d, s, sentinelSums(chunks+1), 0)
			if err := d.chunkSquares(s, upload(t, d, s, wide, 0), wparts); err != nil {
				t.Fatal(err)
			}
			gw := download(t, d, s, wparts)
			for i := range gpart.f {
				if gpart.bits(i) != gw.bits(i) {
					t.Fatalf("n=%d %v: parts word %d = %#x, %#x from the fp32 copy", n, dt, i, gpart.bits(i), gw.bits(i))
				}
			}
			ref := refChunkSums(x)
			want := neumaier(ref)
			total := float64s(download(t, d, s, outs).t())[0]
			bound := gammaSum(chunkAdds(min(n, normChunk)) + chunkAdds(chunks))
			if !(math.Abs(total-want) <= bound*want) {
				t.Fatalf("n=%d %v: total %v, float64 %v (bound %.2g relative)", n, dt, total, want, bound)
			}
			if dt == FP32 {
				var ss float64
				if err := d.sumSquares(s, dx, &ss); err != nil {
					t.Fatal(err)
				}
				if !(math.Abs(total-ss) <= 1e-12*ss) {
					t.Fatalf("n=%d: chunks' total %v, sumSquares %v", n, total, ss)
				}
			}
		}
	}
}

// TestCUDAKernelsSumChunks: each range's sum (empty, one, across the 256
// threads, overlapping others) is within gammaSum of a float64 reference,
// the same bits run to run, and no out past the ranges is written.
func TestCUDAKernelsSumChunks(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	const np = 3000
	parts := sentinelSums(np)
	ps := float64s(parts.t())
	for i := range ps {
		ps[i] = rng.Float64() * math.Ldexp(1, rng.IntN(40)-20)
	}
	ranges := []chunkRange{{0, 0}, {0, 1}, {0, np}, {5, 261}, {1000, 1000}, {7, 2999}, {2999, 3000}, {256, 512}, {100, 356}}
	dparts := upload(t, d, s, parts, 0)
	outs := upload(t, d, s, sentinelSums(len(ranges)+1), 0)
	var first []float64
	for run := range 2 {
		if err := d.sumChunks(s, dparts, ranges, outs); err != nil {
			t.Fatal(err)
		}
		got := float64s(download(t, d, s, outs).t())
		if math.Float64bits(got[len(ranges)]) != sumsSentinel<<32|sumsSentinel {
			t.Fatalf("written past the last range: %v", got[len(ranges)])
		}
		for i, r := range ranges {
			want := neumaier(ps[r.lo:r.hi])
			if bound := gammaSum(chunkAdds(r.hi - r.lo)); !(math.Abs(got[i]-want) <= bound*want) || (r.lo == r.hi && got[i] != 0) {
				t.Fatalf("range %v: %v, float64 %v (bound %.2g relative)", r, got[i], want, bound)
			}
			if run == 1 && math.Float64bits(got[i]) != math.Float64bits(first[i]) {
				t.Fatalf("range %v: %v, then %v", r, first[i], got[i])
			}
		}
		first = got
	}
}

// TestCUDAKernelsSquaresRefuseBadInput: sums too short, misaligned or not
// fp32, a dtype out of range, a segment past the accumulator, a bad range
// and Go slices are typed errors, and the stream is still good.
func TestCUDAKernelsSquaresRefuseBadInput(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	const n = 2*8192 + 1 // three chunks
	x := upload(t, d, s, newGBuf(FP32, n), 0)
	acc := upload(t, d, s, newGBuf(FP32, n), 0)
	parts := upload(t, d, s, newGBuf(FP32, 8), 0)
	short := parts.slice(0, 5)
	odd := parts.slice(1, 6)
	half := upload(t, d, s, newGBuf(BF16, 8), 0)
	badX := x
	badX.dtype = DType(77)
	seg := flatPiece{Src: x}
	host := Float32s(make([]float32, 8))
	for _, c := range []struct {
		name string
		err  error
		want error
	}{
		{"accumulateSquares, parts for 2 of 3 chunks", d.accumulateSquares(s, acc, seg, true, 1, Tensor{}, short), ErrGradSize},
		{"accumulateSquares, parts not 8-byte aligned", d.accumulateSquares(s, acc, seg, true, 1, Tensor{}, odd), ErrGradSize},
		{"accumulateSquares, bf16 parts", d.accumulateSquares(s, acc, seg, true, 1, Tensor{}, half), ErrGradSize},
		{"accumulateSquares, a segment past the accumulator", d.accumulateSquares(s, acc, flatPiece{Src: x, Offset: 1}, true, 1, Tensor{}, parts), ErrGradSize},
		{"accumulateSquares, a bf16 flag", d.accumulateSquares(s, acc, seg, true, 1, half.slice(0, 1), parts), ErrDType},
		{"accumulateSquares, a dtype out of range", d.accumulateSquares(s, acc, flatPiece{Src: badX}, true, 1, Tensor{}, parts), ErrDType},
		{"accumulateSquares, parts in a Go slice", d.accumulateSquares(s, acc, seg, true, 1, Tensor{}, host), ErrStream},
		{"chunkSquares, parts for 2 of 3 chunks", d.chunkSquares(s, x, short), ErrGradSize},
		{"chunkSquares, parts not 8-byte aligned", d.chunkSquares(s, x, odd), ErrGradSize},
		{"chunkSquares, a dtype out of range", d.chunkSquares(s, badX, parts), ErrDType},
		{"chunkSquares, x in a Go slice", d.chunkSquares(s, Float32s(make([]float32, 9)), parts), ErrStream},
		{"sumChunks, a range past parts", d.sumChunks(s, parts, []chunkRange{{0, 5}}, parts.slice(0, 2)), ErrGradSize},
		{"sumChunks, lo > hi", d.sumChunks(s, parts, []chunkRange{{2, 1}}, parts.slice(0, 2)), ErrGradSize},
		{"sumChunks, lo < 0", d.sumChunks(s, parts, []chunkRange{{-1, 1}}, parts.slice(0, 2)), ErrGradSize},
		{"sumChunks, outs for 1 of 2 ranges", d.sumChunks(s, parts, []chunkRange{{0, 1}, {1, 2}}, parts.slice(4, 3)), ErrGradSize},
		{"sumChunks, outs not 8-byte aligned", d.sumChunks(s, parts, []chunkRange{{0, 1}}, odd), ErrGradSize},
		{"sumChunks, outs in a Go slice", d.sumChunks(s, parts, []chunkRange{{0, 1}}, host), ErrStream},
		{"sumChunks, a host stream", d.sumChunks(NewHostStream(), parts, []chunkRange{{0, 1}}, parts.slice(4, 2)), ErrStream},
	} {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: %v, want an error wrapping %v", c.name, c.err, c.want)
		}
	}
	if err := s.Sync(); err != nil {
		t.Fatalf("the stream is still good: %v", err)
	}
}

// TestCUDAKernelsRefuseHostSlices: a Go slice as a kernel operand is an
// error, not a dead CUDA context.
func TestCUDAKernelsRefuseHostSlices(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	x := make([]float32, 16)
	dev, _ := d.Alloc(16, FP32)
	defer d.Free(dev)
	if err := d.flatten(s, dev, []flatPiece{{Src: Float32s(x)}}, 1); !errors.Is(err, ErrStream) {
		t.Errorf("flatten from a Go slice: %v", err)
	}
	if err := d.accumulate(s, Float32s(x), []flatPiece{{Src: dev}}, true, 1, Tensor{}); !errors.Is(err, ErrStream) {
		t.Errorf("accumulate into a Go slice: %v", err)
	}
	if err := d.cast(s, Float32s(x), dev, 1); !errors.Is(err, ErrStream) {
		t.Errorf("cast into a Go slice: %v", err)
	}
	if err := d.copy(s, Float32s(x), dev); err != nil {
		t.Errorf("copy to a Go slice is allowed: %v", err)
	}
	if err := d.flatten(NewHostStream(), dev, []flatPiece{{Src: dev}}, 1); !errors.Is(err, ErrStream) {
		t.Errorf("a host stream on the CUDA device: %v", err)
	}
	if err := s.Sync(); err != nil {
		t.Fatalf("the stream is still good: %v", err)
	}
}

// ---- devices, memory, streams, events ---------------------------------------------

func TestCUDADevices(t *testing.T) {
	n, err := CUDADeviceCount()
	if err != nil {
		// no driver here: CUDA() must say so with a typed error
		_, err2 := CUDA(0)
		var ce *CUDAError
		if !errors.Is(err2, ErrNoCUDA) || !errors.Is(err2, ErrCUDA) || !errors.As(err2, &ce) || !strings.Contains(err2.Error(), "libcuda.so.1") {
			t.Fatalf("CUDA(0) without a driver: %v; want ErrNoCUDA wrapping a *CUDAError that names libcuda.so.1", err2)
		}
		skipOrFail(t, "no CUDA device: %v", err)
	}
	if _, err := CUDA(n); !errors.Is(err, ErrDevice) {
		t.Fatalf("CUDA(%d) of %d devices: %v; want ErrDevice", n, n, err)
	}
	if _, err := CUDA(-1); !errors.Is(err, ErrDevice) {
		t.Fatalf("CUDA(-1): %v", err)
	}
	d0, _ := CUDA(0)
	d1, _ := CUDA(0)
	if d0 != d1 {
		t.Fatal("CUDA(0) twice gave two devices")
	}
	t.Logf("%d device(s); %s", n, d0.Name())
}

func TestCUDAStreamsEvents(t *testing.T) {
	d := needCUDA(t)
	a := gpuStream(t, d)
	b := gpuStream(t, d)
	x, _ := d.Alloc(1<<20, FP32)
	y, _ := d.Alloc(1<<20, FP32)
	src, _ := d.Alloc(1<<20, FP32)
	defer d.Free(x)
	defer d.Free(y)
	defer d.Free(src)
	host := newGBuf(FP32, 1<<20)
	for i := range host.f {
		host.f[i] = float32(i)
	}
	// Upload first: a copy from pageable host memory may hold the host until
	// the stream gets to it, which would hide the spin below.
	if err := d.copy(a, src, host.t()); err != nil {
		t.Fatal(err)
	}
	if err := a.Sync(); err != nil {
		t.Fatal(err)
	}
	start, err := a.Record()
	if err != nil {
		t.Fatal(err)
	}
	if err := cudaSpin(a, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := d.copy(a, x, src); err != nil { // device to device: asynchronous
		t.Fatal(err)
	}
	ready, _ := a.Record()
	if ready.Done() {
		t.Fatal("event done while its stream spins")
	}
	// b copies x only after a wrote it
	if err := b.Wait(ready); err != nil {
		t.Fatal(err)
	}
	if err := d.copy(b, y, x); err != nil {
		t.Fatal(err)
	}
	got := download(t, d, b, y)
	if got.f[12345] != 12345 {
		t.Fatalf("b did not wait for a: %v", got.f[12345])
	}
	if !ready.Done() {
		t.Fatal("event not done after the waiting stream synced")
	}
	el, err := Elapsed(start, ready)
	if err != nil || el < 40*time.Millisecond {
		t.Fatalf("Elapsed over a 50ms spin: %v, %v", el, err)
	}
	// a framework's own stream, by handle
	h, err := StreamHandle(a)
	if err != nil || h == 0 {
		t.Fatalf("StreamHandle: %#x, %v", h, err)
	}
	wrapped, err := CUDAStream(h, d)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.zero(wrapped, x); err != nil {
		t.Fatal(err)
	}
	if err := wrapped.Close(); err != nil { // syncs, does not destroy
		t.Fatal(err)
	}
	if err := d.copy(a, y, x); err != nil || a.Sync() != nil {
		t.Fatalf("the framework's stream must survive Close of its wrapper: %v", err)
	}
	if _, err := CUDAStream(h, CPU()); !errors.Is(err, ErrStream) {
		t.Errorf("CUDAStream on the CPU device: %v", err)
	}
	// A CUDA stream waits on a host stream's event without blocking the
	// caller: the work after the wait runs once the host work has.
	hs := NewHostStream()
	defer hs.Close()
	gate := make(chan struct{})
	hs.Launch(func() error { <-gate; return nil })
	hev, _ := hs.Record()
	if err := a.Wait(hev); err != nil {
		t.Fatalf("waiting on a host event: %v", err)
	}
	after, err := a.Record()
	if err != nil {
		t.Fatal(err)
	}
	if after.Done() {
		t.Error("the CUDA stream went past a host event that had not fired")
	}
	close(gate)
	if err := after.Sync(); err != nil {
		t.Errorf("after the host event fired: %v", err)
	}
	if _, err := d.Alloc(1<<50, FP32); !errors.Is(err, ErrCUDA) {
		t.Errorf("a 4 PiB allocation: %v; want a CUDA error", err)
	} else {
		var ce *CUDAError
		errors.As(err, &ce)
		t.Logf("as expected: %v (code %d)", err, ce.Code)
	}
}

func TestCUDAAllocPinned(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	p, err := AllocPinned(d, 1<<20, BF16)
	if err != nil {
		t.Fatal(err)
	}
	defer FreePinned(d, p)
	h := unsafe.Slice((*uint16)(unsafe.Pointer(&p.hostBytes()[0])), p.Len())
	for i := range h {
		if h[i] != 0 {
			t.Fatal("pinned memory not zeroed")
		}
		h[i] = uint16(i)
	}
	dev, _ := d.Alloc(1<<20, BF16)
	defer d.Free(dev)
	back, _ := AllocPinned(d, 1<<20, BF16)
	defer FreePinned(d, back)
	if err := d.copy(s, dev, p); err != nil {
		t.Fatal(err)
	}
	if err := d.copy(s, back, dev); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	hb := unsafe.Slice((*uint16)(unsafe.Pointer(&back.hostBytes()[0])), back.Len())
	for i := range hb {
		if hb[i] != uint16(i) {
			t.Fatalf("pinned round trip: element %d = %d", i, hb[i])
		}
	}
}

// ---- the one-GPU in-process group ----------------------------------------------------

// onGPURanks runs fn on every rank of a one-GPU group, each with its own stream.
func onGPURanks(t *testing.T, d *cudaDevice, n int, timeout time.Duration, fn func(c Comm, s Stream) error) []error {
	t.Helper()
	comms, err := NewCUDALocalGroupTimeout(n, d, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return eachRank(n, func(r int) error {
		s, err := d.NewStream()
		if err != nil {
			return err
		}
		defer s.Close()
		if err := fn(comms[r], s); err != nil {
			return err
		}
		return s.Sync()
	})
}

// TestCUDAGroupCollectivesMatchCPU: every collective of the one-GPU group
// gives the bits of the CPU group on the same data.
func TestCUDAGroupCollectivesMatchCPU(t *testing.T) {
	d := needCUDA(t)
	rng := testRNG(t)
	for _, w := range []int{2, 4} {
		for _, dt := range allDTypes {
			chunk := 1000 + rng.IntN(3000)
			in := make([]*gbuf, w)
			for r := range w {
				in[r] = newGBuf(dt, w*chunk)
				in[r].fill(rng, false)
			}
			run := func(gpu bool) [][]*gbuf {
				out := make([][]*gbuf, w)
				job := func(c Comm, s Stream, dev Device, up func(*gbuf) Tensor, down func(Tensor) *gbuf) error {
					r := c.Rank()
					var res []*gbuf
					for _, op := range []ReduceOp{OpSum, OpAvg, OpMax} {
						buf := up(in[r])
						if err := c.AllReduce(s, buf, op); err != nil {
							return err
						}
						res = append(res, down(buf))
						send := up(in[r])
						if err := c.ReduceScatter(s, send, send.slice(r*chunk, chunk), op); err != nil { // in place
							return err
						}
						res = append(res, down(send.slice(r*chunk, chunk)))
					}
					all := up(newGBuf(dt, w*chunk))
					mine := up(in[r])
					if err := c.AllGather(s, mine.slice(0, chunk), all); err != nil {
						return err
					}
					res = append(res, down(all))
					bc := up(in[r])
					if err := c.Broadcast(s, bc, w-1); err != nil {
						return err
					}
					res = append(res, down(bc))
					out[r] = res
					return nil
				}
				var errs []error
				if gpu {
					errs = onGPURanks(t, d, w, 20*time.Second, func(c Comm, s Stream) error {
						return job(c, s, d, func(b *gbuf) Tensor { return upload(t, d, s, b, 0) },
							func(x Tensor) *gbuf { return download(t, d, s, x) })
					})
				} else {
					comms, _ := NewLocalGroupTimeout(w, 20*time.Second)
					errs = make([]error, w)
					var wg sync.WaitGroup
					for r := range w {
						wg.Add(1)
						go func() {
							defer wg.Done()
							s := NewHostStream()
							defer s.Close()
							errs[r] = job(comms[r], s, CPU(), func(b *gbuf) Tensor { return b.clone().t() },
								func(x Tensor) *gbuf {
									s.Sync()
									b := newGBuf(x.dtype, x.count)
									copy(b.t().hostBytes(), x.hostBytes())
									return b
								})
						}()
					}
					wg.Wait()
				}
				for r, err := range errs {
					if err != nil {
						t.Fatalf("gpu=%v w=%d %v rank %d: %v", gpu, w, dt, r, err)
					}
				}
				return out
			}
			cpu, gpu := run(false), run(true)
			for r := range w {
				for k := range cpu[r] {
					if i, ok := gpu[r][k].sameAs(cpu[r][k]); !ok {
						t.Fatalf("w=%d %v rank %d result %d: element %d = %#x on the GPU, %#x on the CPU", w, dt, r, k, i, gpu[r][k].bits(i), cpu[r][k].bits(i))
					}
				}
				// W a power of two: the group's average (rank-order fp32 sum,
				// then one scale by 1/W) has the bits of its sum times 1/W,
				// fp16's subnormal range aside, where the sum rounds first.
				sum, avg := gpu[r][0], gpu[r][2]
				for i := range sum.len() {
					want := refEncode(dt, sum.val(i)*float32(1/float64(w)))
					if dt == FP16 && math.Abs(float64(sum.val(i))) < math.Ldexp(1, -13) {
						continue
					}
					if !sameBits(dt, avg.bits(i), want) {
						t.Fatalf("w=%d %v rank %d: average [%d] = %#x, sum/%d = %#x", w, dt, r, i, avg.bits(i), w, want)
					}
				}
			}
		}
	}
}

// TestCUDAGroupPeerFails: a rank that never comes makes the others' calls
// fail with ErrTimeout within the timeout; a rank that closes makes them fail
// with ErrPeerFailed. Never a hang.
func TestCUDAGroupPeerFails(t *testing.T) {
	d := needCUDA(t)
	buf, _ := d.Alloc(1024, FP32)
	defer d.Free(buf)
	start := time.Now()
	errs := onGPURanks(t, d, 3, 300*time.Millisecond, func(c Comm, s Stream) error {
		if c.Rank() == 2 {
			return nil // returns early
		}
		return c.AllReduce(s, buf, OpSum)
	})
	if !errors.Is(errs[0], ErrTimeout) || !errors.Is(errs[1], ErrTimeout) {
		t.Fatalf("peers of a vanished rank: %v", errs)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("took %v", time.Since(start))
	}
	errs = onGPURanks(t, d, 2, 20*time.Second, func(c Comm, s Stream) error {
		if c.Rank() == 1 {
			return c.Close()
		}
		time.Sleep(50 * time.Millisecond)
		return c.AllReduce(s, buf, OpSum)
	})
	if !errors.Is(errs[0], ErrPeerFailed) {
		t.Fatalf("peer closed: %v", errs[0])
	}
	errs = onGPURanks(t, d, 2, 20*time.Second, func(c Comm, s Stream) error {
		if c.Rank() == 1 {
			return c.AllReduce(s, buf.slice(0, 512), OpSum)
		}
		return c.AllReduce(s, buf, OpSum)
	})
	if !errors.Is(errs[0], ErrCollectiveMismatch) && !errors.Is(errs[1], ErrCollectiveMismatch) {
		t.Fatalf("mismatched collectives: %v", errs)
	}
}

// ---- the engine on the GPU ---------------------------------------------------------

// TestCUDADifferentialMatrix: stages 1–3 × W 2, 4 × every dtype × overlap on
// the one-GPU group give the bits of the CPU path (the same arithmetic in the
// same order: flatten, rank-order reduce-scatter, copy-vs-add), for the
// shards and the full gradients, with several buckets, producer streams and
// backwards per step.
func TestCUDADifferentialMatrix(t *testing.T) {
	d := needCUDA(t)
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(uint64(seed), 1))
	n := 0
	for _, stage := range []int{1, 2, 3} {
		for _, world := range []int{2, 4} {
			for _, dt := range allDTypes {
				params := testParams(dt)
				for _, overlap := range []bool{false, true} {
					r := runSpec{stage: stage, world: world, dtype: dt, backwards: 2, steps: 2, streams: 2,
						overlap: overlap, bucket: 1024, predivide: float64(world)}
					data := makeWorkload(mrand.New(mrand.NewSource(rng.Int64())), r, params)
					cpu := runEngine(t, r, params, data, seed)
					gpu := runEngineCUDA(t, d, r, params, data, seed)
					for rank := range world {
						for step := range r.steps {
							for i, want := range cpu[rank].shard[step] {
								if got := gpu[rank].shard[step][i]; math.Float32bits(got) != math.Float32bits(want) {
									t.Fatalf("%v rank %d step %d: shard[%d] = %x on the GPU, %x on the CPU", r, rank, step, i, math.Float32bits(got), math.Float32bits(want))
								}
							}
							for p := range params {
								for i, want := range cpu[rank].full[step][p] {
									if got := gpu[rank].full[step][p][i]; math.Float32bits(got) != math.Float32bits(want) {
										t.Fatalf("%v rank %d step %d: param %d[%d] = %x on the GPU, %x on the CPU", r, rank, step, p, i, math.Float32bits(got), math.Float32bits(want))
									}
								}
							}
						}
					}
					n++
				}
			}
		}
	}
	t.Logf("%d combinations bit-identical to the CPU path", n)
}

// TestCUDAProducerStreamRule: one bucket is filled from four CUDA streams;
// a middle reporter's stream is held back by a spin kernel before it writes
// its gradient. The reduction must wait on every producer's event (seed
// 002); with the engine's wait narrowed to the last producer
// (waitOnlyLastProducer), it reads the bucket too early and the sum is
// wrong.
func TestCUDAProducerStreamRule(t *testing.T) {
	d := needCUDA(t)
	params := []Param{{Count: 1 << 20, DType: FP32}, {Count: 1000, DType: FP32}, {Count: 3000, DType: FP32}, {Count: 1 << 18, DType: FP32}}
	group := func(n int) ([]Comm, error) { return NewCUDALocalGroup(n, d) }
	producerRule(t, params, group, d, func(e *Engine, p int, grad Tensor, s Stream, hold bool) (func(), error) {
		g, err := d.Alloc(grad.count, FP32)
		if err != nil {
			return nil, err
		}
		staged, err := d.Alloc(grad.count, FP32)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { d.Free(g); d.Free(staged) }) // after every stream is closed
		// Upload first: a copy from pageable host memory may hold the host
		// until the stream gets to it, which would hide the spin below.
		if err := d.copy(s, staged, grad); err != nil {
			return nil, err
		}
		if err := s.Sync(); err != nil {
			return nil, err
		}
		if hold {
			if err := cudaSpin(s, 300*time.Millisecond); err != nil {
				return nil, err
			}
		}
		// the framework writes the gradient on its stream (device to
		// device: asynchronous)...
		if err := d.copy(s, g, staged); err != nil {
			return nil, err
		}
		// ...and reports it at once; the spin releases itself
		_, err = e.GradReady(p, g, s)
		return nil, err
	})
}

// TestGPUStatsNVML: NVML's used memory of the GPUs grows by what the engine's
// device allocated.
func TestGPUStatsNVML(t *testing.T) {
	d := needCUDA(t)
	before, err := GPUMemoryInfo()
	if err != nil {
		skipOrFail(t, "no NVML on this GPU host: %v", err)
	}
	used := func(ms []GPUMemory) (u uint64) {
		for _, m := range ms {
			u += m.Used
		}
		return u
	}
	x, err := d.Alloc(1<<30, BF16) // 2 GiB
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(x)
	after, err := GPUMemoryInfo()
	if err != nil {
		t.Fatal(err)
	}
	grew := int64(used(after)) - int64(used(before))
	if grew < 1900<<20 {
		t.Fatalf("NVML used memory grew by %d MiB after a 2 GiB allocation", grew>>20)
	}
	free, total, err := d.memInfo()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range after {
		t.Logf("NVML GPU %d %s: %d MiB used, %d MiB free of %d MiB", m.Index, m.Name, m.Used>>20, m.Free>>20, m.Total>>20)
	}
	t.Logf("cudaMemGetInfo %s: %d MiB free of %d MiB", d.Name(), free>>20, total>>20)

	// The engine reads the same figures when asked (never on its own).
	comms, err := NewCUDALocalGroup(1, d)
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Config{Stage: 2, BucketBytes: 1 << 20}, comms[0], []Param{{Count: 1 << 20, DType: BF16}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if m := e.DeviceMemory(); len(m) != len(after) || used(m) == 0 {
		t.Fatalf("DeviceMemory() = %+v, want %d GPUs with memory in use", m, len(after))
	}
}

// ---- NCCL -------------------------------------------------------------------------------

// TestNCCLLoaderMissing: a library that does not exist is a clear ErrNCCL,
// not a crash (the binary started without NCCL).
func TestNCCLLoaderMissing(t *testing.T) {
	msg, err := probeNCCL("/nonexistent/libnccl.so.2")
	if err == nil {
		t.Fatal("loading a missing library succeeded")
	}
	if !strings.Contains(msg, "nonexistent") {
		t.Errorf("dlopen message %q does not name the file", msg)
	}
	if _, err := NewNCCL(NCCLConfig{World: 1, Library: "/nonexistent/libnccl.so.2"}); ncclLoaded() {
		t.Logf("NCCL was already loaded by an earlier test; NewNCCL went on: %v", err)
	} else if !errors.Is(err, ErrNCCL) || !strings.Contains(err.Error(), "ZERO_NCCL_LIBRARY") {
		t.Fatalf("NewNCCL without NCCL: %v; want ErrNCCL saying how to provide it", err)
	}
}

// TestNCCLLoaderVersion loads the real NCCL (the wheel's in CI, PyTorch's on
// the GPU hosts): no GPU is needed.
func TestNCCLLoaderVersion(t *testing.T) {
	v := needNCCL(t)
	if v < 21900 {
		t.Fatalf("NCCL version code %d; ncclAvg and non-blocking communicators need 2.19 or later", v)
	}
	t.Logf("NCCL %d.%d.%d", v/10000, v/100%100, v%100)
	if os.Getenv("ZERO_NCCL_LIBRARY") == "" {
		// with NCCL loaded and no GPU, NewNCCL fails on the device
		if _, err := CUDA(0); err != nil {
			if _, err := NewNCCL(NCCLConfig{World: 1}); !errors.Is(err, ErrDevice) && !errors.Is(err, ErrNoCUDA) {
				t.Fatalf("NewNCCL without a device: %v; want ErrDevice or ErrNoCUDA", err)
			}
		}
	}
}

// TestNCCLWorld1: bootstrap from torchrun's environment, every collective,
// the watchdog's timeout and a clean abort, with one rank.
func TestNCCLWorld1(t *testing.T) {
	if os.Getenv("ZERO_FAKE_CUDA") == "1" {
		t.Skip("NCCL needs the real driver: its CUDA runtime cannot use the fake one")
	}
	d := needCUDA(t)
	needNCCL(t)
	for k, v := range map[string]string{"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"} {
		t.Setenv(k, v)
	}
	c, err := NewNCCLFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Rank() != 0 || c.Size() != 1 || c.Device() != Device(d) {
		t.Fatalf("rank %d size %d device %v", c.Rank(), c.Size(), c.Device())
	}
	s := gpuStream(t, d)
	rng := testRNG(t)
	for _, dt := range allDTypes {
		in := newGBuf(dt, 4099)
		in.fill(rng, false)
		for _, op := range []ReduceOp{OpSum, OpAvg, OpMax} {
			buf := upload(t, d, s, in, 0)
			if err := c.AllReduce(s, buf, op); err != nil {
				t.Fatal(err)
			}
			if got := download(t, d, s, buf); !gpuSameBits(got, in) {
				t.Fatalf("AllReduce %v %v over one rank changed the data", dt, op)
			}
			send := upload(t, d, s, in, 0)
			recv := upload(t, d, s, newGBuf(dt, in.len()), 0)
			if err := c.ReduceScatter(s, send, recv, op); err != nil {
				t.Fatal(err)
			}
			if got := download(t, d, s, recv); !gpuSameBits(got, in) {
				t.Fatalf("ReduceScatter %v %v over one rank", dt, op)
			}
		}
		send := upload(t, d, s, in, 0)
		recv := upload(t, d, s, newGBuf(dt, in.len()), 0)
		if err := c.AllGather(s, send, recv); err != nil {
			t.Fatal(err)
		}
		if got := download(t, d, s, recv); !gpuSameBits(got, in) {
			t.Fatalf("AllGather %v over one rank", dt)
		}
		if err := c.Broadcast(s, send, 0); err != nil {
			t.Fatal(err)
		}
		if got := download(t, d, s, send); !gpuSameBits(got, in) {
			t.Fatalf("Broadcast %v over one rank", dt)
		}
	}
	cnt := c.Counters()
	if cnt[KindAllReduce].Calls != 9 || cnt[KindReduceScatter].Calls != 9 || cnt[KindAllGather].Calls != 3 || cnt[KindBroadcast].Calls != 3 || cnt.Total().WireBytes != 0 {
		t.Fatalf("counters %+v", cnt)
	}
	buf, _ := d.Alloc(8, FP32)
	defer d.Free(buf)
	if err := c.AllReduce(s, buf, ReduceOp(9)); !errors.Is(err, ErrConfig) {
		t.Errorf("bad op: %v", err)
	}
	if err := c.AllReduce(s, Float32s(make([]float32, 8)), OpSum); !errors.Is(err, ErrStream) {
		t.Errorf("a Go slice to NCCL: %v", err)
	}
	// a clean abort: later calls say why, Close is quiet, the stream lives on
	nc := c.(*ncclComm)
	nc.abort(errorf(ErrPeerFailed, "test abort"))
	if err := c.AllReduce(s, buf, OpSum); !errors.Is(err, ErrPeerFailed) {
		t.Fatalf("after abort: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("Close after abort: %v", err)
	}
	if err := s.Sync(); err != nil {
		t.Fatalf("stream after abort: %v", err)
	}
}

// TestNCCLWatchdogTimeout: a batch that does not finish within the timeout
// (its stream is held by a spin kernel) makes the watchdog abort the
// communicator; later calls return ErrTimeout.
func TestNCCLWatchdogTimeout(t *testing.T) {
	if os.Getenv("ZERO_FAKE_CUDA") == "1" {
		t.Skip("NCCL needs the real driver: its CUDA runtime cannot use the fake one")
	}
	d := needCUDA(t)
	needNCCL(t)
	c, err := NewNCCL(NCCLConfig{World: 1, Timeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := gpuStream(t, d)
	buf, _ := d.Alloc(1024, FP32)
	defer d.Free(buf)
	if err := cudaSpin(s, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := c.AllReduce(s, buf, OpSum); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := c.AllReduce(s, buf, OpSum)
		if errors.Is(err, ErrTimeout) && errors.Is(err, ErrNCCL) {
			t.Logf("watchdog: %v", err)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the watchdog did not abort a batch stuck for 2s with a 300ms timeout (last: %v)", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := s.Sync(); err != nil {
		t.Fatalf("stream after the watchdog's abort: %v", err)
	}
}

func gpuSameBits(a, b *gbuf) bool {
	_, ok := a.sameAs(b)
	return ok
}

// ---- regressions of the runtime-API version -------------------------------------

// flattenBatch enqueues on s the flatten of nseg fp32 gradients (uploaded
// beforehand on a stream of their own, so s may be held) into a flat
// buffer, and returns the check of the result.
func flattenBatch(t *testing.T, d *cudaDevice, s Stream, nseg int, base float32) func() {
	t.Helper()
	up := gpuStream(t, d)
	segs := make([]flatPiece, nseg)
	want := make([]float32, nseg*8)
	for k := range nseg {
		g := newGBuf(FP32, 8)
		for i := range g.f {
			g.f[i] = base + float32(k*8+i)
			want[k*8+i] = g.f[i]
		}
		segs[k] = flatPiece{Src: upload(t, d, up, g, 0), Offset: k * 8}
	}
	if err := up.Sync(); err != nil {
		t.Fatal(err)
	}
	dst, err := d.Alloc(nseg*8, FP32)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Free(dst) })
	if err := d.flatten(s, dst, segs, 1); err != nil {
		t.Fatalf("flatten of %d segments: %v", nseg, err)
	}
	return func() {
		got := download(t, d, s, dst)
		for i, w := range want {
			if got.f[i] != w {
				t.Fatalf("flatten of %d segments: element %d = %g, want %g", nseg, i, got.f[i], w)
			}
		}
	}
}

// TestCUDALaunchAfterNotReadyQuery: a not-ready event query (as the ring,
// Event.Done and the NCCL watchdog make) must not fail a later, correct
// launch on the same thread, as the runtime API's sticky "last error" did.
func TestCUDALaunchAfterNotReadyQuery(t *testing.T) {
	d := needCUDA(t)
	held, other := gpuStream(t, d), gpuStream(t, d)
	check := flattenBatch(t, d, other, 3, 1) // inline descriptors: one launch
	if err := cudaSpin(held, 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	ev, err := held.Record()
	if err != nil {
		t.Fatal(err)
	}
	if ev.Done() { // a not-ready query
		t.Fatal("the held stream's event fired during the spin")
	}
	again := flattenBatch(t, d, other, 3, 7) // a launch after it
	check()
	again()
	if err := held.Sync(); err != nil {
		t.Fatal(err)
	}
}

// heldStream is a stream of d whose work waits behind a 300 ms spin on
// another stream, and the event that ends the wait.
func heldStream(t *testing.T, d *cudaDevice) (Stream, Event) {
	t.Helper()
	s, gate := gpuStream(t, d), gpuStream(t, d)
	if err := cudaSpin(gate, 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	held, err := gate.Record()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(held); err != nil {
		t.Fatal(err)
	}
	return s, held
}

// TestCUDARingBatchesBackToBack: two batches of more than ZC_INLINE_SEGS
// segments (descriptors through the staging ring), the second issued while
// the first still waits behind a spin, both give their own results.
func TestCUDARingBatchesBackToBack(t *testing.T) {
	d := needCUDA(t)
	s, held := heldStream(t, d)
	first := flattenBatch(t, d, s, 40, 0)
	second := flattenBatch(t, d, s, 50, 1000)
	if held.Done() {
		t.Error("the spin ended before both batches were issued; the test saw no overlap")
	}
	first()
	second()
}

// TestCUDARingWrapsBehindAHeldLaunch: three batches of 12000 descriptors
// (375 KiB each; the staging ring holds 1 MiB, so the third wraps onto the
// first's bytes) issued while the first batch's launch still waits behind a
// spin: the ring must not hand the first batch's bytes out again before
// that launch ran, and each batch gives its own result.
func TestCUDARingWrapsBehindAHeldLaunch(t *testing.T) {
	d := needCUDA(t)
	s, held := heldStream(t, d)
	const nseg = 12000
	var checks []func()
	for b := range 3 {
		src := newGBuf(FP32, nseg*8)
		for i := range src.f {
			src.f[i] = float32(b*1_000_000 + i)
		}
		up := gpuStream(t, d)
		dsrc := upload(t, d, up, src, 0)
		if err := up.Sync(); err != nil {
			t.Fatal(err)
		}
		segs := make([]flatPiece, nseg)
		for k := range segs { // each segment's 8 elements land reversed in order of segments
			segs[k] = flatPiece{Src: dsrc.slice(k*8, 8), Offset: (nseg - 1 - k) * 8}
		}
		dst, err := d.Alloc(nseg*8, FP32)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Free(dst) })
		if err := d.flatten(s, dst, segs, 1); err != nil {
			t.Fatalf("batch %d: %v", b, err)
		}
		if b == 0 && held.Done() {
			t.Error("the spin ended before the first batch was issued; the test saw no wait")
		}
		checks = append(checks, func() {
			got := download(t, d, s, dst)
			for k := range nseg {
				for i := range 8 {
					if w := src.f[k*8+i]; got.f[(nseg-1-k)*8+i] != w {
						t.Fatalf("batch %d: segment %d element %d = %g, want %g", b, k, i, got.f[(nseg-1-k)*8+i], w)
					}
				}
			}
		})
	}
	for _, check := range checks {
		check()
	}
}

// TestCUDALocalDevice: with one visible device (the launcher set
// CUDA_VISIBLE_DEVICES per process) every local rank uses ordinal 0; with
// all of them visible, LOCAL_RANK picks the device.
func TestCUDALocalDevice(t *testing.T) {
	for _, tc := range []struct{ rank, visible, want int }{{0, 1, 0}, {3, 1, 0}, {3, 8, 3}, {0, 8, 0}} {
		if got := pickLocalDevice(tc.rank, tc.visible); got != tc.want {
			t.Errorf("LOCAL_RANK %d with %d visible: device %d, want %d", tc.rank, tc.visible, got, tc.want)
		}
	}
	if os.Getenv("ZERO_FAKE_CUDA") == "1" { // one fake device, LOCAL_RANK 5
		if d, err := localDevice(5); err != nil || d != 0 {
			t.Errorf("localDevice(5) with one device: %d, %v; want 0", d, err)
		}
	}
}

// TestCUDAKernelsOptimizerMatchHost: the fused AdamW (with and without
// amsgrad) and SGD (momentum, dampening, Nesterov, weight decay) passes give
// the host kernels' bits for the master shard, the moments and the
// model-dtype copy, in every dtype, over interleaved groups' ranges with a
// gap, three steps in a row, with a few non-finite gradients.
func TestCUDAKernelsOptimizerMatchHost(t *testing.T) {
	d := needCUDA(t)
	s := gpuStream(t, d)
	rng := testRNG(t)
	groups := []struct {
		kind optKind
		opts []Optimizer
	}{
		{optAdamW, []Optimizer{with(NewAdamW(1e-3), func(o *AdamW) { o.WeightDecay = 0.01 }), with(NewAdamW(3e-3), func(o *AdamW) { o.Beta1 = 0.8; o.Beta2 = 0.99; o.AMSGrad = true })}},
		{optSGD, []Optimizer{with(NewSGD(0.05), func(o *SGD) { o.Momentum = 0.9; o.WeightDecay = 1e-4 }), with(NewSGD(0.02), func(o *SGD) { o.Momentum = 0.9; o.Nesterov = true })}},
		{optSGD, []Optimizer{NewSGD(0.1), with(NewSGD(0.05), func(o *SGD) { o.Momentum = 0.5; o.Dampening = 0.3 })}},
	}
	for _, n := range []int{5000, 1<<20 + 3} {
		for _, gr := range groups {
			for _, outType := range allDTypes {
				host := map[string]*gbuf{}
				for _, name := range []string{"p", "g", "m", "v", "vmax"} {
					host[name] = newGBuf(FP32, n)
				}
				for i := range n {
					host["p"].f[i] = float32(rng.NormFloat64())
				}
				out := newGBuf(outType, n)
				dev := map[string]Tensor{}
				for name, b := range host {
					dev[name] = upload(t, d, s, b, 0)
				}
				dout := upload(t, d, s, out, 0)
				for step := 1; step <= 3; step++ {
					for i := range n {
						host["g"].f[i] = float32(rng.NormFloat64() * 0.1)
					}
					for range 3 {
						host["g"].f[rng.IntN(n)] = []float32{float32(math.Inf(1)), float32(math.NaN())}[rng.IntN(2)]
					}
					if err := d.copy(s, dev["g"], host["g"].t()); err != nil {
						t.Fatal(err)
					}
					var ranges []optRange
					for off, k := 0, 0; off < n-100; k++ {
						c := min(1+rng.IntN(n/7), n-100-off)
						r := optRange{offset: int64(off), count: int64(c)}
						gr.opts[k%2].rangeFor(&r, step)
						ranges = append(ranges, r)
						off += c
					}
					const gscale = 0.5
					hb := optBuffers{p: host["p"].t().ptr, g: host["g"].t().ptr, m: host["m"].t().ptr, v: host["v"].t().ptr,
						vmax: host["vmax"].t().ptr, buf: host["m"].t().ptr, out: out.t().ptr, outType: outType}
					if gr.kind == optAdamW {
						adamwHost(hb, ranges, gscale, n)
					} else {
						sgdHost(hb, ranges, gscale, n)
					}
					db := optTensors{p: dev["p"], g: dev["g"], m: dev["m"], v: dev["v"], vmax: dev["vmax"], out: dout}
					if err := d.optimize(s, gr.kind, db, ranges, gscale); err != nil {
						t.Fatal(err)
					}
					for _, name := range []string{"p", "m", "v", "vmax"} {
						got := download(t, d, s, dev[name])
						if i, ok := got.sameAs(host[name]); !ok {
							t.Fatalf("n=%d %v out %v step %d: %s[%d] = %#x on the GPU, %#x on the host", n, gr.opts, outType, step, name, i, got.bits(i), host[name].bits(i))
						}
					}
					got := download(t, d, s, dout)
					if i, ok := got.sameAs(out); !ok {
						t.Fatalf("n=%d %v out %v step %d: out[%d] = %#x on the GPU, %#x on the host", n, gr.opts, outType, step, i, got.bits(i), out.bits(i))
					}
				}
			}
		}
	}
}

// TestCUDATrainingMatchesCPU: AdamW training with the parameters and the
// gradients in GPU memory, on the one-GPU group, gives the CPU path's bits
// after every step at stages 1 and 2 (the same reductions, the same fused
// optimizer, the cast and the all-gather into the parameters' memory).
func TestCUDATrainingMatchesCPU(t *testing.T) {
	d := needCUDA(t)
	seed := testSeed(t)
	rng := mrand.New(mrand.NewSource(seed))
	env := gpuTrainEnv(d)
	opt := with(NewAdamW(0.01), func(o *AdamW) { o.WeightDecay = 0.01 })
	n := 0
	for _, dt := range []DType{FP32, BF16} {
		for _, world := range []int{2, 4} {
			for _, backwards := range []int{1, 3} {
				q := newQuadTask(rng, []int{37, 130, 8, 257, 3000}, 8, world*backwards)
				for _, stage := range []int{1, 2} {
					for _, variant := range []struct {
						bucket  int
						overlap bool
					}{{512, true}, {1 << 20, false}} {
						r := trainRun{stage: stage, world: world, backwards: backwards, dtype: dt, bucket: variant.bucket, overlap: variant.overlap}
						trainsAsCPU(t, env, q, opt, r, r)
						n++
					}
				}
			}
		}
	}
	t.Logf("%d training runs bit-identical to the CPU path", n)
}

// TestCUDAStage3Gather: stage 3 on the one-GPU group with the parameters in
// GPU memory: the gathered views hold rank 0's values after New, and after
// an SGD step the values the step computed (x − lr·1 for a mean gradient of
// ones, exact in fp32), with the optimizer on the GPU and offloaded to the
// host, and with the parameter shard in page-locked host memory
// (Offload.Params); every byte is freed at Close.
func TestCUDAStage3Gather(t *testing.T) {
	d := needCUDA(t)
	for _, offload := range []OffloadPolicy{{}, {Optimizer: true}, {Params: true}, {Optimizer: true, Params: true}} {
		cudaStage3Gather(t, d, offload)
	}
}

func cudaStage3Gather(t *testing.T, d *cudaDevice, offload OffloadPolicy) {
	const world = 2
	sizes := []int{300, 1000, 77}
	comms, err := NewCUDALocalGroupTimeout(world, d, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	errs := eachRank(world, func(rank int) error {
		defer comms[rank].Close()
		s, err := d.NewStream()
		if err != nil {
			return err
		}
		defer s.Close()
		ps := make([]Param, len(sizes))
		var frees []Tensor
		defer func() {
			for _, x := range frees {
				d.Free(x)
			}
		}()
		put := func(vals []float32) (Tensor, error) {
			x, err := d.Alloc(len(vals), FP32)
			if err != nil {
				return Tensor{}, err
			}
			frees = append(frees, x)
			if err := d.copy(s, x, Float32s(vals)); err != nil {
				return Tensor{}, err
			}
			return x, s.Sync()
		}
		for p, n := range sizes {
			vals := make([]float32, n)
			for i := range vals {
				vals[i] = float32(p*1000 + i)
				if rank > 0 {
					vals[i] = 100 // rank 0's values must win the broadcast
				}
			}
			x, err := put(vals)
			if err != nil {
				return err
			}
			ps[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: FP32, Data: x}
		}
		e, err := New(Config{Stage: 3, BucketBytes: 2048, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.5)}}, Offload: offload}, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		check := func(shift float32) error {
			views, err := e.Gather(s, 0, 1, 2)
			if err != nil {
				return err
			}
			for p, v := range views {
				got := newGBuf(FP32, v.Len())
				if err := d.copy(s, got.t(), v); err != nil {
					return err
				}
				if err := s.Sync(); err != nil {
					return err
				}
				for i, x := range got.f {
					if want := float32(p*1000+i) - shift; x != want {
						return fmt.Errorf("param %d[%d] = %v, want %v", p, i, x, want)
					}
				}
			}
			return e.Release(s, 0, 1, 2)
		}
		if err := check(0); err != nil {
			return fmt.Errorf("after New: %w", err)
		}
		for p := len(sizes) - 1; p >= 0; p-- {
			ones := make([]float32, sizes[p])
			for i := range ones {
				ones[i] = 1
			}
			g, err := put(ones)
			if err != nil {
				return err
			}
			if _, err := e.GradReady(p, g, s); err != nil {
				return err
			}
		}
		if err := e.EndBackward(); err != nil {
			return err
		}
		if err := e.Step(); err != nil {
			return err
		}
		if err := check(0.5); err != nil {
			return fmt.Errorf("after a step: %w", err)
		}
		return nil
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("offload %+v rank %d: %v", offload, rank, err)
		}
	}
}

// TestCUDACoalesceMatchesCPU: coalesced windows and NoSync on the one-GPU
// group, with fp32 and model-dtype window sums and a budget, give the CPU
// path's bits.
func TestCUDACoalesceMatchesCPU(t *testing.T) {
	d := needCUDA(t)
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(uint64(seed), 3))
	n := 0
	for _, dt := range []DType{BF16, FP16, FP32} {
		params := testParams(dt)
		for _, stage := range []int{1, 2, 3} {
			for _, window := range []string{"coalesce", "nosync"} {
				for _, wdt := range []DType{FP32, dt} {
					for _, budget := range []int{0, 3000} {
						r := runSpec{stage: stage, world: 2, dtype: dt, backwards: 3, steps: 2, streams: 2, overlap: stage != 2,
							bucket: 1024, predivide: 1, window: window, windowEvery: false, windowDType: wdt, budget: budget}
						data := makeWorkload(mrand.New(mrand.NewSource(rng.Int64())), r, params)
						cpu := runEngine(t, r, params, data, seed)
						gpu := runEngineCUDA(t, d, r, params, data, seed)
						if err := sameShards(cpu, gpu); err != nil {
							t.Fatalf("%v window %s in %v budget %d: %v", r, window, wdt, budget, err)
						}
						n++
					}
				}
			}
		}
	}
	t.Logf("%d window configurations bit-identical to the CPU path", n)
}

// TestCUDATimedEventsRecycled: a steady-state training loop (AdamW, with
// and without offload, stage 2 and 3) creates no timed event that the
// garbage collector must destroy: every span's events are recycled.
func TestCUDATimedEventsRecycled(t *testing.T) {
	d := needCUDA(t)
	collected := func() int64 {
		for range 3 {
			runtime.GC()
			time.Sleep(20 * time.Millisecond) // cleanups run on their own goroutine
		}
		return timedEventsCollected.Load()
	}
	for _, stage := range []int{2, 3} {
		for _, offload := range []bool{false, true} {
			comms, err := NewCUDALocalGroupTimeout(1, d, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			sizes := []int{300, 64, 1000}
			params := make([]Param, len(sizes))
			grads := make([]Tensor, len(sizes))
			for p, n := range sizes {
				data, err := d.Alloc(n, FP32)
				if err != nil {
					t.Fatal(err)
				}
				defer d.Free(data)
				if grads[p], err = d.Alloc(n, FP32); err != nil {
					t.Fatal(err)
				}
				defer d.Free(grads[p])
				params[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: FP32, Data: data}
			}
			e, err := New(Config{Stage: stage, BucketBytes: 1024, Overlap: true, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}},
				Offload: OffloadPolicy{Optimizer: offload}}, comms[0], params)
			if err != nil {
				t.Fatal(err)
			}
			s := gpuStream(t, d)
			step := func() {
				if stage == 3 {
					if _, err := e.Gather(s, 0, 1, 2); err != nil {
						t.Fatal(err)
					}
					if err := e.Release(s, 0, 1, 2); err != nil {
						t.Fatal(err)
					}
				}
				if err := backward(e, s, grads); err != nil {
					t.Fatal(err)
				}
				if err := e.Step(); err != nil {
					t.Fatal(err)
				}
			}
			for range 5 { // the pools fill
				step()
			}
			before := collected()
			for range 20 {
				step()
			}
			if after := collected(); after != before {
				t.Errorf("stage %d offload %v: 20 steps left %d timed events to the garbage collector", stage, offload, after-before)
			}
			e.Close()
			comms[0].Close()
		}
	}
}

// TestCUDAFreeAfterQueuedWork: a stream-ordered free of device memory
// returns at once and leaves the memory allocated while a queued copy still
// writes it (the fake driver's cuMemFree, like a real one's where it does
// not synchronise, would free it under the copy); it is freed once the
// stream gets past the copy.
func TestCUDAFreeAfterQueuedWork(t *testing.T) {
	d := fakeCUDA(t)
	s := gpuStream(t, d)
	const n = 1 << 20
	src, err := d.Alloc(n, FP32)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(src)
	x, err := d.Alloc(n, FP32)
	if err != nil {
		t.Fatal(err)
	}
	before, _, err := d.memInfo()
	if err != nil {
		t.Fatal(err)
	}
	if err := cudaSpin(s, 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := d.copy(s, x, src); err != nil { // device to device: queued behind the spin
		t.Fatal(err)
	}
	freeAfter(d, x, s)
	if now, _, _ := d.memInfo(); now != before {
		t.Fatalf("%d bytes freed while the copy into them was queued", now-before)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if now, _, _ := d.memInfo(); now == before+4*n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("not freed 10 s after the stream drained")
		}
	}
}

// TestCUDAReductionEventErrorReachesStep: a reduction whose event's wait
// fails (the fake driver's cuEventSynchronize of the reduction stream's
// untimed events; nothing else fails, so that wait is the only place that
// sees it) fails Step with the CUDA error, with and without Overlap, at
// every stage, and the engine refuses to go on.
func TestCUDAReductionEventErrorReachesStep(t *testing.T) {
	d := fakeCUDA(t)
	params := testParams(FP32)
	for _, stage := range []int{1, 2, 3} {
		for _, overlap := range []bool{false, true} {
			what := fmt.Sprintf("stage %d overlap=%v", stage, overlap)
			comms, err := NewCUDALocalGroup(1, d)
			if err != nil {
				t.Fatal(err)
			}
			e, err := New(Config{Stage: stage, BucketBytes: 1024, Overlap: overlap}, comms[0], params)
			if err != nil {
				t.Fatal(err)
			}
			s := gpuStream(t, d)
			grads := make([]Tensor, len(params))
			for p, q := range params {
				g := newGBuf(FP32, q.Count)
				for i := range g.f {
					g.f[i] = 1
				}
				grads[p] = upload(t, d, s, g, 0)
			}
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			// where reductions run: the engine's stream, and without
			// Overlap the caller's that completed the bucket
			rh, _ := StreamHandle(e.reduceStream)
			sh, _ := StreamHandle(s)
			if err := backward(e, s, grads); err != nil {
				t.Fatal(err)
			}
			os.Setenv("FAKECUDA_FAIL_EVENT_SYNC", fmt.Sprintf("%d,%d", rh, sh))
			err = e.Step()
			os.Unsetenv("FAKECUDA_FAIL_EVENT_SYNC")
			var ce *CUDAError
			if !errors.As(err, &ce) || ce.Name != "CUDA_ERROR_LAUNCH_FAILED" || !errors.Is(err, ErrCollective) {
				t.Errorf("%s: Step returned %v; want the failed wait's CUDA_ERROR_LAUNCH_FAILED, fatal", what, err)
			}
			if _, err := e.GradShard(); !errors.Is(err, ErrCollective) {
				t.Errorf("%s: GradShard after the failure: %v, want ErrCollective", what, err)
			}
			e.Close()
			comms[0].Close()
		}
	}
}
