/*
 * kernels.h: the host C kernels of zero (compiled by cgo from kernels.c).
 *
 * Every kernel works on an element range [lo, hi), so the Go side can split a
 * large range across cores (parallelRange in kernels.go); the kernels
 * themselves are single-threaded. The scalar math comes from elementwise.h,
 * shared with the CUDA kernels, so both paths give the same bits.
 *
 * Pointers of different arguments must not overlap, except where a kernel
 * says otherwise (zero_reduce's dst may be one of its srcs).
 */
#ifndef ZERO_KERNELS_H
#define ZERO_KERNELS_H

#include <stdint.h>

#include "elementwise.h"

/* One gradient of a batch: its address, its element count, and the offset
 * (in elements) of its first element in the flat destination. The layout
 * matches the Go type segment in kernels.go. */
typedef struct {
	uintptr_t ptr;
	int64_t count;
	int64_t offset;
} zero_seg;

/* flatten: for every flat element j in [lo, hi) that a segment covers,
 * dst[j] = cast_dst(load_src(seg.ptr, j - seg.offset) * scale); the multiply
 * is skipped when scale == 1. Elements no segment covers are left as they are.
 * Segments must not overlap one another in the destination. */
void zero_flatten(void* dst, int dst_dtype, const zero_seg* segs, int nseg, int src_dtype, float scale,
                  int64_t lo, int64_t hi);

/* accumulate (copy-vs-add) into acc of acc_dtype (fp32, bf16 or fp16): for
 * every covered j in [lo, hi): v = load_src(...) * scale (skipped when
 * scale == 1); acc[j] = store_acc(first ? v : load_acc(acc, j) + v), the sum
 * in fp32, rounded once to acc_dtype. If any stored value is inf or NaN,
 * *flag = 1.0f (flag may be NULL; it is never cleared), so a 16-bit sum that
 * rounds to inf raises it. One pass. Another acc_dtype does nothing. */
void zero_accumulate(void* acc, int acc_dtype, const zero_seg* segs, int nseg, int src_dtype, int first, float scale,
                     float* flag, int64_t lo, int64_t hi);

/* cast: dst[i] = cast_dst(load_src(src, i) * scale) for i in [lo, hi). */
void zero_cast(void* dst, int dst_dtype, const void* src, int src_dtype, float scale, int64_t lo, int64_t hi);

/* Sum of squares of x[lo..hi), in double. Element lo+i goes to lane i % 16,
 * the lanes are added in a fixed tree, so the result depends only on the
 * values and the range. Each square of an fp32 value is exact in double. */
double zero_sumsq(const float* x, int64_t lo, int64_t hi);

/* The norm's chunks: the global norm of the gradient shard is summed per
 * chunk of ZERO_NORM_CHUNK elements (the CUDA accumulate's block, ZC_CHUNK),
 * so the landing can sum what it stored while the chunk is in cache. */
#define ZERO_NORM_CHUNK 8192

/* Chunk sums of squares of x (fp32, bf16 or fp16): chunk k covers
 * [origin + k*ZERO_NORM_CHUNK, +ZERO_NORM_CHUNK) clipped to hi; for every
 * chunk starting in [lo, hi) (lo on a chunk boundary), sums[k] = zero_sumsq
 * of its values widened to fp32. A chunk's sum depends only on its values. */
void zero_chunk_squares(const void* x, int dtype, int64_t origin, int64_t lo, int64_t hi, double* sums);

/* accumulate of the one segment seg over [lo, hi) (lo on a chunk boundary
 * from seg->offset, hi on one or at the segment's end), that also writes the
 * chunk sums of the values it stored: sums[k] is what zero_chunk_squares
 * gives for chunk k (origin seg->offset) afterwards, bit for bit. */
void zero_accumulate_squares(void* acc, int acc_dtype, const zero_seg* seg, int src_dtype, int first, float scale,
                             float* flag, int64_t lo, int64_t hi, double* sums);

/* reduce: for i in [lo, hi): dst[i] = op over srcs[0..n-1], in rank order, in
 * fp32 (elementwise.h: zero_op_combine, zero_op_finish), stored once in dtype.
 * dst may be one of the srcs: every input of a chunk is read before the chunk
 * of dst is written. Where two NaNs meet, which payload survives is not
 * specified (a NaN result is). */
void zero_reduce(void* dst, const uintptr_t* srcs, int n, int dtype, int op, int64_t lo, int64_t hi);

/* fused in-place all-reduce: read every buffer's elements once, form the op
 * result in fp32 in rank order, and write it (cast to dtype) to every buffer
 * while it is in cache: chunk by chunk through an fp32 work space on the
 * stack (ZK_CHUNK in kernels.c), and bf16 vector by vector in registers. */
void zero_allreduce_fused(const uintptr_t* bufs, int n, int dtype, int op, int64_t lo, int64_t hi);

/* AdamW (and SGD) on the fp32 master shard p with its moments m, v (vmax
 * with amsgrad; buf for SGD momentum, NULL without), for the shard elements
 * in [lo, hi) that the ranges cover, each range with its parameter's
 * settings (elementwise.h: zero_adamw_elem, zero_sgd_elem). The gradient g
 * is multiplied by gscale on the way in (the mean's 1/G, the loss scale's
 * unscale and the clipping, folded). The new parameter, cast to out_dtype,
 * is written to out at the same index (out may be NULL). One pass. */
void zero_adamw(float* p, float* m, float* v, float* vmax, const float* g, void* out, int out_dtype,
                const zero_opt_range* ranges, int nr, float gscale, int64_t lo, int64_t hi);
void zero_sgd(float* p, float* buf, const float* g, void* out, int out_dtype, const zero_opt_range* ranges, int nr,
              float gscale, int64_t lo, int64_t hi);

/* unflatten, the inverse of flatten in one dtype: for every flat element j
 * in [lo, hi) that a segment covers, seg.ptr[j - seg.offset] = flat[j]. */
void zero_unflatten(const void* flat, int dtype, const zero_seg* segs, int nseg, int64_t lo, int64_t hi);

/* ISA level of the hot loops: 0 = x86-64-v2 baseline (and every non-x86
 * machine), 1 = AVX2 (x86-64-v3), 2 = AVX-512 (x86-64-v4). By default the
 * widest the CPU supports. All levels give the same bits. */
int zero_kernel_level(void);
/* Sets the level (tests and benchmarks); a level < 0 or above what the CPU
 * supports selects the CPU's best. Returns the level now in use. The level is
 * read once per kernel call, atomically, so it may change at any time. */
int zero_set_kernel_level(int level);
/* Sets how the kernels move memory (tests and benchmarks): software prefetch
 * on or off, the reductions' chunk in elements (16..256), and non-temporal
 * stores for bit copies of 1 MiB or more. Any argument < 0 restores the
 * CPU's choice. Returns swpf | chunk << 1 | ntcopy << 16. No setting changes
 * any result. */
int zero_set_kernel_tuning(int swpf, int chunk, int ntcopy);

/* Benchmark yardsticks: the simplest C loops that move the same bytes as a
 * kernel, over [lo, hi). Used only by bench_kernels_test.go. */
void zero_yard_copy16(uint16_t* dst, const uint16_t* src, int64_t lo, int64_t hi);
void zero_yard_copy32(uint32_t* dst, const uint32_t* src, int64_t lo, int64_t hi);
void zero_yard_widen(uint32_t* dst, const uint16_t* src, int64_t lo, int64_t hi);
void zero_yard_narrow(uint16_t* dst, const uint32_t* src, int64_t lo, int64_t hi);
void zero_yard_add32(float* acc, const float* src, int64_t lo, int64_t hi);
void zero_yard_add16(float* acc, const uint16_t* src, int64_t lo, int64_t hi);
void zero_yard_add16x16(uint16_t* acc, const uint16_t* src, int64_t lo, int64_t hi);
uint32_t zero_yard_read32(const uint32_t* x, int64_t lo, int64_t hi);
void zero_yard_sum4_32(float* dst, const float* a, const float* b, const float* c, const float* d, int64_t lo,
                       int64_t hi);
void zero_yard_sum4_16(uint16_t* dst, const uint16_t* a, const uint16_t* b, const uint16_t* c,
                       const uint16_t* d, int64_t lo, int64_t hi);
void zero_yard_allsum4_32(float* a, float* b, float* c, float* d, int64_t lo, int64_t hi);
void zero_yard_inc32(float* x, int64_t lo, int64_t hi);
void zero_yard_optpass(uint16_t* out, float* p, const float* g, float* m, float* v, int64_t lo, int64_t hi);

/* Copies bytes with non-temporal stores (no read-for-ownership of dst). */
void zero_copy_stream(void* dst, const void* src, int64_t bytes);

#endif /* ZERO_KERNELS_H */
