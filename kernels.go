package zero

/*
#cgo CFLAGS: -O3 -Wall
#cgo amd64 CFLAGS: -march=x86-64-v2
#cgo LDFLAGS: -lm
// -ffp-contract=off is not on cgo's list of allowed flags; elementwise.h sets
// it with a pragma instead, for every function after its #include.
#include "kernels.h"

// Thin wrappers that take addresses as uintptr_t and cast them here, in C,
// so the Go side never converts a uintptr variable to unsafe.Pointer.
static inline void zk_flatten_u(uintptr_t dst, int dt, const zero_seg* segs, int nseg, int st, float scale,
                                int64_t lo, int64_t hi) {
	zero_flatten((void*)dst, dt, segs, nseg, st, scale, lo, hi);
}
static inline void zk_accumulate_u(uintptr_t acc, int at, const zero_seg* segs, int nseg, int st, int first,
                                   float scale, float* flag, int64_t lo, int64_t hi) {
	zero_accumulate((void*)acc, at, segs, nseg, st, first, scale, flag, lo, hi);
}
static inline void zk_set_flag_u(uintptr_t flag) { *(float*)flag = 1.0f; }
static inline void zk_cast_u(uintptr_t dst, int dt, uintptr_t src, int st, float scale, int64_t lo, int64_t hi) {
	zero_cast((void*)dst, dt, (const void*)src, st, scale, lo, hi);
}
static inline void zk_chunk_squares_u(uintptr_t x, int dt, int64_t origin, int64_t lo, int64_t hi, uintptr_t sums) {
	zero_chunk_squares((const void*)x, dt, origin, lo, hi, (double*)sums);
}
static inline void zk_accumulate_squares_u(uintptr_t acc, int at, const zero_seg* seg, int st, int first, float scale,
                                           float* flag, int64_t lo, int64_t hi, uintptr_t sums) {
	zero_accumulate_squares((void*)acc, at, seg, st, first, scale, flag, lo, hi, (double*)sums);
}
static inline double zk_sumsq_u(uintptr_t x, int64_t lo, int64_t hi) {
	return zero_sumsq((const float*)x, lo, hi);
}
static inline void zk_reduce_u(uintptr_t dst, const uintptr_t* srcs, int n, int dt, int op, int64_t lo, int64_t hi) {
	zero_reduce((void*)dst, srcs, n, dt, op, lo, hi);
}
static inline void zk_adamw_u(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t vmax, uintptr_t g, uintptr_t out,
                              int out_dt, const zero_opt_range* r, int nr, float gscale, int64_t lo, int64_t hi) {
	zero_adamw((float*)p, (float*)m, (float*)v, (float*)vmax, (const float*)g, (void*)out, out_dt, r, nr, gscale, lo, hi);
}
static inline void zk_sgd_u(uintptr_t p, uintptr_t buf, uintptr_t g, uintptr_t out, int out_dt,
                            const zero_opt_range* r, int nr, float gscale, int64_t lo, int64_t hi) {
	zero_sgd((float*)p, (float*)buf, (const float*)g, (void*)out, out_dt, r, nr, gscale, lo, hi);
}
static inline void zk_unflatten_u(uintptr_t flat, int dt, const zero_seg* segs, int nseg, int64_t lo, int64_t hi) {
	zero_unflatten((const void*)flat, dt, segs, nseg, lo, hi);
}
static inline uint16_t zk_bf16_from(float f) { return zero_f32_to_bf16(f); }
static inline float zk_bf16_to(uint16_t h) { return zero_bf16_to_f32(h); }
static inline uint16_t zk_fp16_from(float f) { return zero_f32_to_f16(f); }
static inline float zk_fp16_to(uint16_t h) { return zero_f16_to_f32(h); }

// Benchmark yardsticks (bench_kernels_test.go); kind selects the loop.
static inline void zk_copy_stream_u(uintptr_t d, uintptr_t s, int64_t n) { zero_copy_stream((void*)d, (const void*)s, n); }

static inline uint32_t zk_yard_u(int kind, uintptr_t d, uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t e,
                                 int64_t lo, int64_t hi) {
	switch (kind) {
	case 0: zero_yard_copy16((uint16_t*)d, (const uint16_t*)a, lo, hi); break;
	case 1: zero_yard_copy32((uint32_t*)d, (const uint32_t*)a, lo, hi); break;
	case 2: zero_yard_widen((uint32_t*)d, (const uint16_t*)a, lo, hi); break;
	case 3: zero_yard_narrow((uint16_t*)d, (const uint32_t*)a, lo, hi); break;
	case 4: zero_yard_add32((float*)d, (const float*)a, lo, hi); break;
	case 5: zero_yard_add16((float*)d, (const uint16_t*)a, lo, hi); break;
	case 6: return zero_yard_read32((const uint32_t*)a, lo, hi);
	case 7: zero_yard_sum4_32((float*)d, (const float*)a, (const float*)b, (const float*)c, (const float*)e, lo, hi); break;
	case 8: zero_yard_sum4_16((uint16_t*)d, (const uint16_t*)a, (const uint16_t*)b, (const uint16_t*)c, (const uint16_t*)e, lo, hi); break;
	case 9: zero_yard_allsum4_32((float*)a, (float*)b, (float*)c, (float*)e, lo, hi); break;
	case 10: zero_yard_inc32((float*)d, lo, hi); break;
	case 11: zero_yard_optpass((uint16_t*)d, (float*)a, (const float*)b, (float*)c, (float*)e, lo, hi); break;
	case 12: zero_yard_add16x16((uint16_t*)d, (const uint16_t*)a, lo, hi); break;
	}
	return 0;
}
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// Compile-time checks that segment and zero_seg have the same layout.
var (
	_ [unsafe.Sizeof(segment{}) - C.sizeof_zero_seg]byte
	_ [C.sizeof_zero_seg - unsafe.Sizeof(segment{})]byte
	_ [unsafe.Offsetof(segment{}.count) - 8]byte
	_ [8 - unsafe.Offsetof(segment{}.count)]byte
	_ [unsafe.Offsetof(segment{}.offset) - 16]byte
	_ [16 - unsafe.Offsetof(segment{}.offset)]byte
)

// parallelThreshold is the element count below which a host kernel runs on
// the calling goroutine: under it, waking goroutines costs more than a second
// core saves (128K fp32 elements are 512 KiB, some tens of µs of work).
const parallelThreshold = 128 << 10

// parallelAlign aligns part boundaries to 64 elements (a multiple of every
// vector width and of a 64-byte cache line for 2- and 4-byte elements).
const parallelAlign = 64

// maxParts caps the number of parts of a split (and so the goroutines of one
// kernel call).
const maxParts = 64

// parallelParts splits [0, n) into min(runtime.GOMAXPROCS(0), maxParts) parts, with
// boundaries aligned to parallelAlign elements, calls fn(k, lo, hi) for part k
// (part 0 on the calling goroutine, the others on their own goroutines), waits
// for all of them, and returns the number of parts. Below parallelThreshold
// elements it makes one part. The split depends only on n and GOMAXPROCS.
func parallelParts(n int, fn func(k, lo, hi int)) int {
	return parallelPartsAligned(n, parallelAlign, fn)
}

// parallelPartsAligned is parallelParts with boundaries aligned to align
// elements (a power of two).
func parallelPartsAligned(n, align int, fn func(k, lo, hi int)) int {
	if n <= 0 {
		return 0
	}
	p := min(runtime.GOMAXPROCS(0), maxParts)
	if n < parallelThreshold || p <= 1 {
		fn(0, 0, n)
		return 1
	}
	bound := func(k int) int {
		if k >= p {
			return n
		}
		b := int(int64(n) * int64(k) / int64(p))
		return b &^ (align - 1)
	}
	var wg sync.WaitGroup
	for k := 1; k < p; k++ {
		lo, hi := bound(k), bound(k+1)
		if lo >= hi {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(k, lo, hi)
		}()
	}
	if hi := bound(1); hi > 0 {
		fn(0, 0, hi)
	}
	wg.Wait()
	return p
}

// parallelRange runs fn over [0, n), split across cores as parallelParts does.
func parallelRange(n int, fn func(lo, hi int)) {
	parallelParts(n, func(_, lo, hi int) { fn(lo, hi) })
}

// segExtent returns the flat range [lo, hi) that the segments cover.
func segExtent(segs []segment) (lo, hi int64) {
	lo, hi = -1, 0
	for _, s := range segs {
		if s.count <= 0 {
			continue
		}
		if lo < 0 || s.offset < lo {
			lo = s.offset
		}
		if e := s.offset + s.count; e > hi {
			hi = e
		}
	}
	if lo < 0 {
		return 0, 0
	}
	return lo, hi
}

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// flattenRange runs zero_flatten over the flat range [lo, hi) on the calling
// goroutine.
func flattenRange(dst uintptr, dstType DType, segs []segment, srcType DType, scale float32, lo, hi int64) {
	if len(segs) == 0 || lo >= hi {
		return
	}
	C.zk_flatten_u(C.uintptr_t(dst), C.int(dstType), (*C.zero_seg)(unsafe.Pointer(&segs[0])), C.int(len(segs)),
		C.int(srcType), C.float(scale), C.int64_t(lo), C.int64_t(hi))
}

// flattenHost gathers the segments into the flat buffer dst (dtype dstType):
// dst[seg.offset+i] = dstType(srcType(seg.ptr[i]) * scale), in one pass; the
// multiply is skipped when scale is 1. Elements no segment covers are left as
// they are. The caller keeps all the memory alive.
func flattenHost(dst uintptr, dstType DType, segs []segment, srcType DType, scale float32) {
	lo, hi := segExtent(segs)
	parallelRange(int(hi-lo), func(a, b int) {
		flattenRange(dst, dstType, segs, srcType, scale, lo+int64(a), lo+int64(b))
	})
}

// accumulateRange runs zero_accumulate over [lo, hi) on the calling goroutine.
// flag is a Go float32 the kernel sets to 1 on a non-finite result, or nil.
func accumulateRange(acc uintptr, accType DType, segs []segment, srcType DType, first bool, scale float32, flag *float32,
	lo, hi int64) {
	if len(segs) == 0 || lo >= hi {
		return
	}
	C.zk_accumulate_u(C.uintptr_t(acc), C.int(accType), (*C.zero_seg)(unsafe.Pointer(&segs[0])), C.int(len(segs)),
		C.int(srcType), cbool(first), C.float(scale), (*C.float)(unsafe.Pointer(flag)), C.int64_t(lo), C.int64_t(hi))
}

// accumulateHost is copy-vs-add into acc, of dtype accType (fp32, bf16 or
// fp16): acc[j] = accType((first ? 0 : float(acc[j])) + float(src) * scale)
// for every element j a segment covers, in one pass, the sum formed in fp32
// and rounded once (first copies, so acc's old contents, NaN included, do not
// matter). If any stored value is inf or NaN it stores 1.0 into the float32 at
// address flag (when flag is not 0); it never clears the flag.
func accumulateHost(acc uintptr, accType DType, segs []segment, srcType DType, first bool, scale float32, flag uintptr) {
	lo, hi := segExtent(segs)
	var flags [maxParts]float32 // one per part, so the parts never write one word
	parts := parallelParts(int(hi-lo), func(k, a, b int) {
		accumulateRange(acc, accType, segs, srcType, first, scale, &flags[k], lo+int64(a), lo+int64(b))
	})
	raiseFlag(flag, flags[:parts])
}

// raiseFlag stores 1.0 into the float32 at flag (when not 0) if any part
// raised its own.
func raiseFlag(flag uintptr, parts []float32) {
	if flag == 0 {
		return
	}
	for _, f := range parts {
		if f != 0 {
			C.zk_set_flag_u(C.uintptr_t(flag))
			return
		}
	}
}

// normChunk is the norm's chunk in elements (ZERO_NORM_CHUNK, the CUDA
// accumulate's block): the shard's sum of squares is formed per chunk, so a
// landing can sum what it stored while the chunk is in cache.
const normChunk = C.ZERO_NORM_CHUNK

// chunksOf is the number of norm chunks of n elements.
func chunksOf(n int) int { return (n + normChunk - 1) / normChunk }

// accumulateSquaresHost is accumulateHost of the one segment seg that also
// writes, per chunk of normChunk elements from seg.offset, the sum of squares
// of the values it stored into the float64s at sums (one per chunk), in
// zero_sumsq's order: the same bits chunkSquaresHost gives afterwards.
func accumulateSquaresHost(acc uintptr, accType DType, seg segment, srcType DType, first bool, scale float32, flag, sums uintptr) {
	var flags [maxParts]float32
	parts := parallelPartsAligned(int(seg.count), normChunk, func(k, a, b int) {
		C.zk_accumulate_squares_u(C.uintptr_t(acc), C.int(accType), (*C.zero_seg)(unsafe.Pointer(&seg)), C.int(srcType),
			cbool(first), C.float(scale), (*C.float)(unsafe.Pointer(&flags[k])), C.int64_t(seg.offset+int64(a)),
			C.int64_t(seg.offset+int64(b)), C.uintptr_t(sums))
	})
	raiseFlag(flag, flags[:parts])
}

// chunkSquaresHost writes the chunk sums of squares of x[0..n) (dtype dt)
// into the float64s at sums.
func chunkSquaresHost(x uintptr, dt DType, n int, sums uintptr) {
	parallelPartsAligned(n, normChunk, func(_, a, b int) {
		C.zk_chunk_squares_u(C.uintptr_t(x), C.int(dt), 0, C.int64_t(a), C.int64_t(b), C.uintptr_t(sums))
	})
}

// castRange runs zero_cast over [lo, hi) on the calling goroutine.
func castRange(dst uintptr, dstType DType, src uintptr, srcType DType, scale float32, lo, hi int64) {
	if lo >= hi {
		return
	}
	C.zk_cast_u(C.uintptr_t(dst), C.int(dstType), C.uintptr_t(src), C.int(srcType), C.float(scale),
		C.int64_t(lo), C.int64_t(hi))
}

// castHost converts n elements: dst[i] = dstType(srcType(src[i]) * scale),
// the multiply skipped when scale is 1. dst and src must not overlap.
func castHost(dst uintptr, dstType DType, src uintptr, srcType DType, n int, scale float32) {
	parallelRange(n, func(lo, hi int) {
		castRange(dst, dstType, src, srcType, scale, int64(lo), int64(hi))
	})
}

// sumSquaresRange is zero_sumsq over [lo, hi) on the calling goroutine.
func sumSquaresRange(x uintptr, lo, hi int64) float64 {
	if lo >= hi {
		return 0
	}
	return float64(C.zk_sumsq_u(C.uintptr_t(x), C.int64_t(lo), C.int64_t(hi)))
}

// sumSquaresHost returns the sum of squares of n fp32 values, accumulated in
// float64. Each part of the parallel split is summed by zero_sumsq, and the
// parts' sums are added in part order, so the result is bit-for-bit
// deterministic for a given n and GOMAXPROCS (a different GOMAXPROCS may
// change the last bits).
func sumSquaresHost(x uintptr, n int) float64 {
	var sums [maxParts]float64
	parts := parallelParts(n, func(k, lo, hi int) {
		sums[k] = sumSquaresRange(x, int64(lo), int64(hi))
	})
	var total float64
	for k := 0; k < parts; k++ {
		total += sums[k]
	}
	return total
}

// reduceHost sets dst[i] = op over srcs[0..n-1][i], in rank order in fp32,
// for i in [lo, hi); every buffer has dtype. dst may be one of the srcs. It
// runs on the calling goroutine: the in-process group splits work by rank.
func reduceHost(dst uintptr, srcs []uintptr, dtype DType, op ReduceOp, lo, hi int) {
	if len(srcs) == 0 || lo >= hi {
		return
	}
	C.zk_reduce_u(C.uintptr_t(dst), (*C.uintptr_t)(unsafe.Pointer(&srcs[0])), C.int(len(srcs)), C.int(dtype),
		C.int(op), C.int64_t(lo), C.int64_t(hi))
}

// allReduceFusedHost reduces elements [lo, hi) of every buffer in place: chunk
// by chunk it reads all buffers once, forms op in rank order in fp32, and
// writes the result, cast to dtype, back to every buffer while the chunk is in
// cache. It runs on the calling goroutine, like reduceHost.
func allReduceFusedHost(bufs []uintptr, dtype DType, op ReduceOp, lo, hi int) {
	if len(bufs) == 0 || lo >= hi {
		return
	}
	C.zero_allreduce_fused((*C.uintptr_t)(unsafe.Pointer(&bufs[0])), C.int(len(bufs)), C.int(dtype), C.int(op),
		C.int64_t(lo), C.int64_t(hi))
}

// The flags of elementwise.h's zero_opt_range.
const (
	optAMSGrad  = C.ZERO_OPT_AMSGRAD
	optNesterov = C.ZERO_OPT_NESTEROV
	optFirst    = C.ZERO_OPT_FIRST
)

// The codes that cross into C as integers equal the C side's.
var (
	_ [int(FP32) - C.ZERO_F32]byte
	_ [C.ZERO_F32 - int(FP32)]byte
	_ [int(BF16) - C.ZERO_BF16]byte
	_ [C.ZERO_BF16 - int(BF16)]byte
	_ [int(FP16) - C.ZERO_F16]byte
	_ [C.ZERO_F16 - int(FP16)]byte
	_ [int(OpSum) - C.ZERO_SUM]byte
	_ [C.ZERO_SUM - int(OpSum)]byte
	_ [int(OpAvg) - C.ZERO_AVG]byte
	_ [C.ZERO_AVG - int(OpAvg)]byte
	_ [int(OpMax) - C.ZERO_MAX]byte
	_ [C.ZERO_MAX - int(OpMax)]byte
)

// The Go and C layouts of a range must agree.
var (
	_ [unsafe.Sizeof(optRange{}) - C.sizeof_zero_opt_range]byte
	_ [C.sizeof_zero_opt_range - unsafe.Sizeof(optRange{})]byte
)

// adamwHost runs AdamW over the ranges of a shard of n elements, on both cores.
func adamwHost(b optBuffers, ranges []optRange, gscale float32, n int) {
	if len(ranges) == 0 {
		return
	}
	r := (*C.zero_opt_range)(unsafe.Pointer(&ranges[0]))
	parallelRange(n, func(lo, hi int) {
		C.zk_adamw_u(C.uintptr_t(b.p), C.uintptr_t(b.m), C.uintptr_t(b.v), C.uintptr_t(b.vmax), C.uintptr_t(b.g),
			C.uintptr_t(b.out), C.int(b.outType), r, C.int(len(ranges)), C.float(gscale), C.int64_t(lo), C.int64_t(hi))
	})
}

// sgdHost runs SGD over the ranges of a shard of n elements, on both cores.
func sgdHost(b optBuffers, ranges []optRange, gscale float32, n int) {
	if len(ranges) == 0 {
		return
	}
	r := (*C.zero_opt_range)(unsafe.Pointer(&ranges[0]))
	parallelRange(n, func(lo, hi int) {
		C.zk_sgd_u(C.uintptr_t(b.p), C.uintptr_t(b.buf), C.uintptr_t(b.g), C.uintptr_t(b.out), C.int(b.outType),
			r, C.int(len(ranges)), C.float(gscale), C.int64_t(lo), C.int64_t(hi))
	})
}

// unflattenHost scatters the flat buffer into the segments:
// seg.ptr[i] = flat[seg.offset+i], one dtype, on both cores.
func unflattenHost(flat uintptr, dtype DType, segs []segment) {
	lo, hi := segExtent(segs)
	if len(segs) == 0 || lo >= hi {
		return
	}
	parallelRange(int(hi-lo), func(a, b int) {
		C.zk_unflatten_u(C.uintptr_t(flat), C.int(dtype), (*C.zero_seg)(unsafe.Pointer(&segs[0])), C.int(len(segs)),
			C.int64_t(lo+int64(a)), C.int64_t(lo+int64(b)))
	})
}

// kernelLevel returns the ISA level of the host kernels' hot loops: 0 for the
// x86-64-v2 baseline (and non-x86 machines), 1 for AVX2, 2 for AVX-512. Every
// level gives the same bits.
func kernelLevel() int { return int(C.zero_kernel_level()) }

// setKernelLevel selects an ISA level for tests and benchmarks (a level the
// CPU lacks, or -1, selects the best it has) and returns the level in use.
// Kernels read the level once per call, so changing it while kernels run is
// safe, and since every level gives the same bits, harmless.
func setKernelLevel(level int) int { return int(C.zero_set_kernel_level(C.int(level))) }

// kernelTuning is how the host kernels move memory; the CPU's choice is
// made once (kernels.c, zk_tune_for_cpu) and never changes a result.
type kernelTuning struct {
	prefetch bool // software prefetch (off on AMD with AVX-512: Zen 4 and later)
	chunk    int  // the reductions' chunk in elements (128 on AMD, 256 elsewhere)
	ntCopy   bool // non-temporal stores for bit copies of 1 MiB or more (on AMD)
}

// setKernelTuning sets the tuning (nil: the CPU's choice) and returns the
// one in use, for tests and benchmarks.
func setKernelTuning(t *kernelTuning) kernelTuning {
	a, b, c := -1, -1, -1
	if t != nil {
		a, b, c = btoi(t.prefetch), t.chunk, btoi(t.ntCopy)
	}
	r := int(C.zero_set_kernel_tuning(C.int(a), C.int(b), C.int(c)))
	return kernelTuning{prefetch: r&1 != 0, chunk: r >> 1 & 0x7fff, ntCopy: r>>16 != 0}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// bf16FromFloat rounds f to bf16 (nearest even; NaN stays a quiet NaN).
func bf16FromFloat(f float32) uint16 { return uint16(C.zk_bf16_from(C.float(f))) }

// floatFromBF16 widens bf16 bits to fp32 (exact).
func floatFromBF16(h uint16) float32 { return float32(C.zk_bf16_to(C.uint16_t(h))) }

// fp16FromFloat rounds f to IEEE fp16 (nearest even, subnormals, overflow to
// inf, NaN to a quiet NaN).
func fp16FromFloat(f float32) uint16 { return uint16(C.zk_fp16_from(C.float(f))) }

// floatFromFP16 widens fp16 bits to fp32 (exact; a NaN is quietened).
func floatFromFP16(h uint16) float32 { return float32(C.zk_fp16_to(C.uint16_t(h))) }

// Benchmark yardsticks: the simplest C loop that moves the same bytes as a
// kernel (kernels.c, zero_yard_*), over [lo, hi). Used by bench_kernels_test.go.
type yardKind int

const (
	yardCopy16     yardKind = iota // d[i] = a[i], 2 bytes
	yardCopy32                     // d[i] = a[i], 4 bytes
	yardWiden                      // d[i] (4 bytes) = a[i] (2 bytes)
	yardNarrow                     // d[i] (2 bytes) = a[i] (4 bytes) >> 16
	yardAdd32                      // d[i] += a[i], fp32
	yardAdd16                      // d[i] += float(a[i]), fp32 += uint16
	yardRead32                     // xor of a[i], 4 bytes read
	yardSum4x32                    // d[i] = a[i]+b[i]+c[i]+e[i], fp32
	yardSum4x16                    // d[i] = a[i]+b[i]+c[i]+e[i], uint16
	yardAllSum4x32                 // a[i] = b[i] = c[i] = e[i] = a[i]+b[i]+c[i]+e[i], fp32
	yardInc32                      // d[i] += 1, fp32 in place
	yardOptPass                    // a (p), c (m), e (v) += b (g), d = a's high 16 bits: an optimizer's bytes
	yardAdd16x16                   // d[i] += a[i], uint16 += uint16
)

// copyStream copies n bytes from src to dst with non-temporal stores.
func copyStream(dst, src uintptr, n int) {
	C.zk_copy_stream_u(C.uintptr_t(dst), C.uintptr_t(src), C.int64_t(n))
}

func yardstick(kind yardKind, d, a, b, c, e uintptr, lo, hi int) uint32 {
	return uint32(C.zk_yard_u(C.int(kind), C.uintptr_t(d), C.uintptr_t(a), C.uintptr_t(b), C.uintptr_t(c),
		C.uintptr_t(e), C.int64_t(lo), C.int64_t(hi)))
}
