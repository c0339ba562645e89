package zero

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"sort"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// Benchmarks of the host kernels, each beside a yardstick: the simplest C
// loop that moves the same bytes over the same buffers with the same
// parallelRange split (kernels.c, zero_yard_*). Both run in the same
// benchmark, interleaved, each timed on its own; the benchmark reports
//
//	GB/s         the kernel's bytes read + written per second
//	yard-GB/s    the yardstick's
//	x-yardstick  kernel speed / yardstick speed (target: >= 0.9)
//	isa-level    the kernels' ISA level: 0 x86-64-v2, 1 AVX2, 2 AVX-512
//	             (the yardsticks are always x86-64-v2; they are memory-bound)
//
// ns/op and MB/s cover the kernel alone (the timer stops around the
// yardstick); the metrics above come from the median iteration. BenchmarkKernelFusedFlatten reports x-fused instead: the time of
// the same work as separate passes over the time of the fused flatten.
//
//	go test -run XXX -bench Kernel -benchtime 3x

// ZERO_KERNEL_TUNING=prefetch,chunk,ntcopy (say 1,256,0: the Intel choice)
// runs the benchmarks with another tuning than the CPU's, so the two can be
// compared in one binary, run by run.
func init() {
	v := os.Getenv("ZERO_KERNEL_TUNING")
	if v == "" {
		return
	}
	var pf, chunk, nt int
	if _, err := fmt.Sscanf(v, "%d,%d,%d", &pf, &chunk, &nt); err != nil {
		fmt.Fprintf(os.Stderr, "ZERO_KERNEL_TUNING=%q: want prefetch,chunk,ntcopy such as 1,256,0\n", v)
		os.Exit(2)
	}
	got := setKernelTuning(&kernelTuning{prefetch: pf != 0, chunk: chunk, ntCopy: nt != 0})
	fmt.Fprintf(os.Stderr, "kernel tuning: %+v\n", got)
}

// benchElems is the element count of every benchmark buffer: 64 MiB of fp32.
const benchElems = 64 << 20 / 4

// benchSegs is the number of gradients a flatten or accumulate benchmark
// gathers into its flat buffer.
const benchSegs = 64

var benchBufs struct {
	sync.Mutex
	f32 map[int][]float32
	u16 map[int][]uint16
}

// benchF32 returns shared fp32 buffer k of benchElems random finite values,
// allocated once per process.
func benchF32(k int) []float32 {
	benchBufs.Lock()
	defer benchBufs.Unlock()
	if benchBufs.f32 == nil {
		benchBufs.f32 = map[int][]float32{}
	}
	b, ok := benchBufs.f32[k]
	if !ok {
		rng := rand.New(rand.NewPCG(uint64(k), 1))
		b = make([]float32, benchElems)
		for i := range b {
			b[i] = float32(rng.NormFloat64())
		}
		benchBufs.f32[k] = b
	}
	return b
}

// benchU16 returns shared 16-bit buffer k of benchElems random values of
// dtype dt (bf16 or fp16), allocated once per process and dtype.
func benchU16(k int, dt DType) []uint16 {
	benchBufs.Lock()
	defer benchBufs.Unlock()
	if benchBufs.u16 == nil {
		benchBufs.u16 = map[int][]uint16{}
	}
	key := k*4 + int(dt)
	b, ok := benchBufs.u16[key]
	if !ok {
		rng := rand.New(rand.NewPCG(uint64(key), 2))
		b = make([]uint16, benchElems)
		for i := range b {
			f := float32(rng.NormFloat64())
			if dt == FP16 {
				b[i] = fp16FromFloat(f)
			} else {
				b[i] = bf16FromFloat(f)
			}
		}
		benchBufs.u16[key] = b
	}
	return b
}

func addrF32(x []float32) uintptr { return uintptr(unsafe.Pointer(&x[0])) }
func addrU16(x []uint16) uintptr  { return uintptr(unsafe.Pointer(&x[0])) }

// benchSegments cuts [0, benchElems) of src (elements of size bytes) into
// benchSegs equal gradients.
func benchSegments(src uintptr, size int) []segment {
	per := benchElems / benchSegs
	segs := make([]segment, benchSegs)
	for k := range segs {
		segs[k] = segment{ptr: src + uintptr(k*per*size), count: int64(per), offset: int64(k * per)}
	}
	return segs
}

// yardRange runs a yardstick loop over [0, benchElems) with parallelRange.
func yardRange(kind yardKind, d, a, b, c, e uintptr) func() {
	return func() {
		parallelRange(benchElems, func(lo, hi int) { yardstick(kind, d, a, b, c, e, lo, hi) })
	}
}

// benchLevels runs fn as a sub-benchmark at each ISA level the CPU has
// (isa0 = x86-64-v2, isa1 = AVX2, isa2 = AVX-512), then restores the default.
// The yardsticks are the same plain loops at every level.
func benchLevels(b *testing.B, fn func(b *testing.B)) {
	best := setKernelLevel(-1)
	defer setKernelLevel(-1)
	for l := 0; l <= best; l++ {
		setKernelLevel(l)
		b.Run(fmt.Sprintf("isa%d", l), fn)
	}
}

// vsYardstick times kernel and yard b.N times each, interleaved (the order
// alternates, so neither always runs on a cache the other warmed), and
// reports both speeds from the median iteration, and their ratio. bytes is
// what one call reads plus writes. The machine's memory bandwidth can change
// between runs (other tenants); the ratio of interleaved runs is the figure
// to compare.
func vsYardstick(b *testing.B, bytes int64, kernel, yard func(), keep ...any) {
	vsOther(b, bytes, kernel, yard, "yard-GB/s", "x-yardstick", keep...)
}

// vsOther is vsYardstick against another way of doing the kernel's work,
// reported in otherUnit and, as other's time over the kernel's, ratioUnit.
func vsOther(b *testing.B, bytes int64, kernel, yard func(), otherUnit, ratioUnit string, keep ...any) {
	b.SetBytes(bytes)
	kernel() // first touch and warm-up
	yard()
	tk := make([]time.Duration, 0, b.N)
	ty := make([]time.Duration, 0, b.N)
	timeYard := func() {
		b.StopTimer()
		t := time.Now()
		yard()
		ty = append(ty, time.Since(t))
		b.StartTimer()
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%2 == 1 {
			timeYard()
		}
		t := time.Now()
		kernel()
		tk = append(tk, time.Since(t))
		if i%2 == 0 {
			timeYard()
		}
	}
	b.StopTimer()
	reportPair(b, bytes, median(tk), median(ty), otherUnit, ratioUnit)
	runtime.KeepAlive(keep)
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// reportPair reports the kernel's GB/s, the other's, the other's time over
// the kernel's, and the ISA level.
func reportPair(b *testing.B, bytes int64, kernel, other time.Duration, otherUnit, ratioUnit string) {
	b.ReportMetric(float64(bytes)/kernel.Seconds()/1e9, "GB/s")
	b.ReportMetric(float64(bytes)/other.Seconds()/1e9, otherUnit)
	b.ReportMetric(other.Seconds()/kernel.Seconds(), ratioUnit)
	b.ReportMetric(float64(kernelLevel()), "isa-level")
}

// flatten, bf16 gradients -> bf16 bucket, no pre-scale (PredivideFactor 1,
// the default): a bit copy.
func BenchmarkKernelFlattenBF16Unscaled(b *testing.B) {
	src, dst := benchU16(0, BF16), benchU16(1, BF16)
	segs := benchSegments(addrU16(src), 2)
	vsYardstick(b, 4*benchElems,
		func() { flattenHost(addrU16(dst), BF16, segs, BF16, 1) },
		yardRange(yardCopy16, addrU16(dst), addrU16(src), 0, 0, 0), src, dst)
}

// flatten, bf16 gradients -> bf16 bucket with a pre-scale: 2 B read, 2 B written.
func BenchmarkKernelFlattenBF16(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, dst := benchU16(0, BF16), benchU16(1, BF16)
		segs := benchSegments(addrU16(src), 2)
		vsYardstick(b, 4*benchElems,
			func() { flattenHost(addrU16(dst), BF16, segs, BF16, 0.25) },
			yardRange(yardCopy16, addrU16(dst), addrU16(src), 0, 0, 0), src, dst)
	})
}

// flatten, fp16 gradients -> fp16 bucket with a pre-scale (the costliest
// conversion: subnormals, overflow and NaN on the bits).
func BenchmarkKernelFlattenFP16(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, dst := benchU16(0, FP16), benchU16(1, FP16)
		segs := benchSegments(addrU16(src), 2)
		vsYardstick(b, 4*benchElems,
			func() { flattenHost(addrU16(dst), FP16, segs, FP16, 0.25) },
			yardRange(yardCopy16, addrU16(dst), addrU16(src), 0, 0, 0), src, dst)
	})
}

// flatten, fp32 -> fp32 without scaling (a gather copy).
func BenchmarkKernelFlattenFP32(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, dst := benchF32(0), benchF32(1)
		segs := benchSegments(addrF32(src), 4)
		vsYardstick(b, 8*benchElems,
			func() { flattenHost(addrF32(dst), FP32, segs, FP32, 1) },
			yardRange(yardCopy32, addrF32(dst), addrF32(src), 0, 0, 0), src, dst)
	})
}

// flatten, bf16 gradients -> fp32 bucket (fp32 communication): 2 B read, 4 B written.
func BenchmarkKernelFlattenBF16toFP32(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, dst := benchU16(0, BF16), benchF32(1)
		segs := benchSegments(addrU16(src), 2)
		vsYardstick(b, 6*benchElems,
			func() { flattenHost(addrF32(dst), FP32, segs, BF16, 1) },
			yardRange(yardWiden, addrF32(dst), addrU16(src), 0, 0, 0), src, dst)
	})
}

// accumulate fp32 into fp32 (add): 8 B read, 4 B written.
func BenchmarkKernelAccumulateFP32(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, acc := benchF32(0), benchF32(2)
		segs := benchSegments(addrF32(src), 4)
		flag := make([]float32, 1)
		vsYardstick(b, 12*benchElems,
			func() { accumulateHost(addrF32(acc), FP32, segs, FP32, false, 1, addrF32(flag)) },
			yardRange(yardAdd32, addrF32(acc), addrF32(src), 0, 0, 0), src, acc, flag)
	})
}

// accumulate bf16 into fp32 with a post-scale (add): 6 B read, 4 B written.
func BenchmarkKernelAccumulateBF16(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, acc := benchU16(0, BF16), benchF32(2)
		segs := benchSegments(addrU16(src), 2)
		flag := make([]float32, 1)
		vsYardstick(b, 10*benchElems,
			func() { accumulateHost(addrF32(acc), FP32, segs, BF16, false, 0.125, addrF32(flag)) },
			yardRange(yardAdd16, addrF32(acc), addrU16(src), 0, 0, 0), src, acc, flag)
	})
}

// accumulate into a 16-bit accumulator of the source's dtype with a
// post-scale (add): 4 B read, 2 B written; the yardstick adds uint16s.
func BenchmarkKernelAccumulate16(b *testing.B) {
	for _, dt := range []DType{BF16, FP16} {
		b.Run(dt.String(), func(b *testing.B) {
			benchLevels(b, func(b *testing.B) {
				src, acc := benchU16(0, dt), benchU16(5, dt)
				segs := benchSegments(addrU16(src), 2)
				flag := make([]float32, 1)
				vsYardstick(b, 6*benchElems,
					func() { accumulateHost(addrU16(acc), dt, segs, dt, false, 0.125, addrF32(flag)) },
					yardRange(yardAdd16x16, addrU16(acc), addrU16(src), 0, 0, 0), src, acc, flag)
			})
		})
	}
}

// cast, fp32 master shard -> bf16 parameters: 4 B read, 2 B written.
func BenchmarkKernelCastFP32toBF16(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, dst := benchF32(0), benchU16(1, BF16)
		vsYardstick(b, 6*benchElems,
			func() { castHost(addrU16(dst), BF16, addrF32(src), FP32, benchElems, 1) },
			yardRange(yardNarrow, addrU16(dst), addrF32(src), 0, 0, 0), src, dst)
	})
}

// The landing of a reduced bf16 bucket part into the fp32 shard (add, with
// a post-scale: 10 B moved per element) that also sums the squares of what
// it stored, per chunk, while the chunk is in cache; against the landing
// followed by Step's pass over the shard for the norm (4 B more read per
// element). twopass/fused above 1 is the time the fused landing saves.
func BenchmarkKernelLandingNorm(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, acc := benchU16(0, BF16), benchF32(2)
		seg := segment{ptr: addrU16(src), count: benchElems}
		flag := make([]float32, 1)
		sums := make([]float64, chunksOf(benchElems))
		at := uintptr(unsafe.Pointer(unsafe.SliceData(sums)))
		vsOther(b, 10*benchElems,
			func() { accumulateSquaresHost(addrF32(acc), FP32, seg, BF16, false, 0.125, addrF32(flag), at) },
			func() {
				accumulateHost(addrF32(acc), FP32, []segment{seg}, BF16, false, 0.125, addrF32(flag))
				chunkSquaresHost(addrF32(acc), FP32, benchElems, at)
			}, "twopass-GB/s", "twopass/fused", src, acc, flag, sums)
	})
}

// sum of squares of fp32: 4 B read.
func BenchmarkKernelSumSq(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		x := benchF32(0)
		var sink float64
		vsYardstick(b, 4*benchElems,
			func() { sink += sumSquaresHost(addrF32(x), benchElems) },
			yardRange(yardRead32, 0, addrF32(x), 0, 0, 0), x)
		_ = sink
	})
}

// reduce of 4 ranks' fp32 buffers into a fifth: 16 B read, 4 B written.
func BenchmarkKernelReduceFP32(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		s := []uintptr{addrF32(benchF32(0)), addrF32(benchF32(1)), addrF32(benchF32(2)), addrF32(benchF32(3))}
		dst := benchF32(4)
		vsYardstick(b, 20*benchElems,
			func() {
				parallelRange(benchElems, func(lo, hi int) { reduceHost(addrF32(dst), s, FP32, OpSum, lo, hi) })
			},
			yardRange(yardSum4x32, addrF32(dst), s[0], s[1], s[2], s[3]), dst)
	})
}

// BenchmarkKernelReduceFP32Hot: the reduce of an MPI reduce-scatter's
// parts, which sit in cache when it runs: 4 sources of 256 KiB (a 4 MiB
// buffer over 4 ranks) into a fifth, one thread, against the plain loop.
func BenchmarkKernelReduceFP32Hot(b *testing.B) {
	const n = 64 << 10
	bufs := make([][]float32, 5)
	for k := range bufs {
		bufs[k] = make([]float32, n)
		for i := range bufs[k] {
			bufs[k][i] = float32(k + i%7)
		}
	}
	s := []uintptr{addrF32(bufs[0]), addrF32(bufs[1]), addrF32(bufs[2]), addrF32(bufs[3])}
	dst := addrF32(bufs[4])
	benchLevels(b, func(b *testing.B) {
		vsYardstick(b, 20*n,
			func() { reduceHost(dst, s, FP32, OpSum, 0, n) },
			func() { yardstick(yardSum4x32, dst, s[0], s[1], s[2], s[3], 0, n) }, bufs)
	})
}

// reduce of 4 ranks' bf16 buffers into a fifth: 8 B read, 2 B written.
func BenchmarkKernelReduceBF16(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		s := []uintptr{addrU16(benchU16(0, BF16)), addrU16(benchU16(1, BF16)), addrU16(benchU16(2, BF16)), addrU16(benchU16(3, BF16))}
		dst := benchU16(4, BF16)
		vsYardstick(b, 10*benchElems,
			func() {
				parallelRange(benchElems, func(lo, hi int) { reduceHost(addrU16(dst), s, BF16, OpSum, lo, hi) })
			},
			yardRange(yardSum4x16, addrU16(dst), s[0], s[1], s[2], s[3]), dst)
	})
}

// fused in-place all-reduce of 4 ranks' fp32 buffers: 16 B read, 16 B written.
func BenchmarkKernelAllReduceFusedFP32(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		bufs := [][]float32{make([]float32, benchElems), make([]float32, benchElems), make([]float32, benchElems), make([]float32, benchElems)}
		p := make([]uintptr, len(bufs))
		for r := range bufs {
			copy(bufs[r], benchF32(r))
			p[r] = addrF32(bufs[r])
		}
		// AVG keeps the values bounded however often the benchmark repeats
		vsYardstick(b, 32*benchElems,
			func() {
				parallelRange(benchElems, func(lo, hi int) { allReduceFusedHost(p, FP32, OpAvg, lo, hi) })
			},
			yardRange(yardAllSum4x32, 0, p[0], p[1], p[2], p[3]), bufs)
	})
}

// The fused flatten (bf16 gradients -> bf16 bucket with the pre-scale, one
// pass) against the same work in separate passes, as an unfused pipeline
// would do it: cast the gradients to an fp32 temporary, scale it into a
// second temporary, cast that back into the bucket.
func BenchmarkKernelFusedFlatten(b *testing.B) {
	benchLevels(b, func(b *testing.B) {
		src, dst := benchU16(0, BF16), benchU16(1, BF16)
		segs := benchSegments(addrU16(src), 2)
		tmp1, tmp2 := benchF32(5), benchF32(6)
		fused := func() { flattenHost(addrU16(dst), BF16, segs, BF16, 0.25) }
		separate := func() {
			flattenHost(addrF32(tmp1), FP32, segs, BF16, 1)
			castHost(addrF32(tmp2), FP32, addrF32(tmp1), FP32, benchElems, 0.25)
			castHost(addrU16(dst), BF16, addrF32(tmp2), FP32, benchElems, 1)
		}
		bytes := int64(4 * benchElems)
		b.SetBytes(bytes)
		fused()
		separate()
		tf := make([]time.Duration, 0, b.N)
		ts := make([]time.Duration, 0, b.N)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			t := time.Now()
			fused()
			tf = append(tf, time.Since(t))
			b.StopTimer()
			t = time.Now()
			separate()
			ts = append(ts, time.Since(t))
			b.StartTimer()
		}
		b.StopTimer()
		reportPair(b, bytes, median(tf), median(ts), "separate-GB/s", "x-fused")
		runtime.KeepAlive([]any{src, dst, tmp1, tmp2})
	})
}

// optBenchElems is the shard of the optimizer benchmark: 64 Mi elements
// (1 GiB of fp32 state: p, g, m, v).
const optBenchElems = 64 << 20

// The fused AdamW step over a 64 Mi-element shard, with the bf16 copy of
// the new parameters: reads p, g, m, v and writes p, m, v (4 B each) and
// the copy (2 B), 30 B per element, beside a loop that moves the same bytes
// in place (yardOptPass).
func BenchmarkKernelAdamW(b *testing.B) {
	// p, g, m, v in one allocation, staggered by 4 KiB + 64 B: the
	// yardstick's interleaved streams would otherwise share their page
	// offsets (4K aliasing) and run at a tenth of the bandwidth.
	const stagger = 1040
	all := make([]float32, 4*(optBenchElems+stagger))
	state := make([][]float32, 4)
	for k := range state {
		state[k] = all[k*(optBenchElems+stagger):][:optBenchElems]
		rng := rand.New(rand.NewPCG(uint64(k), 3))
		for i := range state[k] {
			state[k][i] = float32(rng.NormFloat64() * 0.1)
		}
	}
	for i := range state[3] {
		state[3][i] *= state[3][i] // v ≥ 0
	}
	out := make([]uint16, optBenchElems)
	r := optRange{count: optBenchElems}
	with(NewAdamW(1e-3), func(o *AdamW) { o.WeightDecay = 0.01 }).rangeFor(&r, 3)
	bufs := optBuffers{p: addrF32(state[0]), g: addrF32(state[1]), m: addrF32(state[2]), v: addrF32(state[3]),
		buf: addrF32(state[2]), out: addrU16(out), outType: BF16}
	benchLevels(b, func(b *testing.B) {
		vsYardstick(b, 30*optBenchElems,
			func() { adamwHost(bufs, []optRange{r}, 0.5, optBenchElems) },
			func() {
				parallelRange(optBenchElems, func(lo, hi int) {
					yardstick(yardOptPass, bufs.out, bufs.p, bufs.g, bufs.m, bufs.v, lo, hi)
				})
			}, all, out)
	})
}
