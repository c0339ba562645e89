/*
 * kernels.c: the host C kernels (see kernels.h). Compiled by cgo with the
 * flags in kernels.go (-O3 -march=x86-64-v2 on amd64); elementwise.h turns
 * floating-point contraction off.
 *
 * Every hot loop is specialised for its dtypes, its op and whether it scales:
 * a switch outside the loop calls an always-inline loop body with constant
 * arguments, so the compiler folds the dtype switches of zero_load/zero_store
 * away and vectorises what is left. No loop switches on a dtype per element.
 *
 * ISA levels. On x86-64 with gcc or clang the hot functions are compiled
 * three times: for the x86-64-v2 baseline (SSE4.2), for AVX2 (x86-64-v3) and
 * for AVX-512 (x86-64-v4); at run time the widest level the CPU and OS
 * support is used. To compile one function body several times this file
 * includes itself: the first pass (ZK_TEMPLATE undefined) holds the shared
 * code and includes the file once per level with ZK_TEMPLATE, ZK_FN and
 * ZK_TARGET set; the second part of the file is that template. Every level
 * performs the same IEEE fp32 operations on each element in the same order
 * (contraction is off, so no FMA is formed even where the ISA has it); the
 * wider ones only do more elements per instruction, so all levels give the
 * same bits. One exception in how, not in what: at levels 1 and 2 the fp16
 * conversions use the F16C instructions, which implement the same rounding
 * as elementwise.h (see ZK_F16C below). zero_set_kernel_level lets the tests
 * run every level the machine has and compare them bit for bit.
 *
 * Streaming. The streaming kernels (flatten, cast, accumulate, sum of
 * squares) walk their arrays in blocks of ZK_BLOCK elements and prefetch each
 * array ZK_PF elements ahead: the conversions cost enough per element that the
 * hardware prefetcher alone leaves memory latency exposed.
 */
#ifndef ZK_TEMPLATE

#include <string.h>

#include "kernels.h"

#define ZK_INLINE static inline __attribute__((always_inline))
#define ZK_FLATTEN __attribute__((flatten)) /* inline every call, whatever the budget */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ZK_MULTI 1
#define ZK_TARGET_V3 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
#define ZK_TARGET_V4 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,popcnt")))
#else
#define ZK_MULTI 0
#endif

/* Chunk of the reductions, in elements: every rank's chunk is read into an
 * fp32 work space on the stack (1 KiB), and the next chunk of every rank is
 * prefetched meanwhile. (The bf16 reductions take one pass per vector and use
 * the chunk only to prefetch: zk_reduce_bf16.) Small chunks keep all ranks' streams in flight at once,
 * as a loop over all ranks per element would; measured on 4 ranks of 64 MiB,
 * 256 elements ran at 0.9-1.0x the plain loop, 4096 (16 KiB) at 0.6-0.8x. */
#ifndef ZK_CHUNK
#define ZK_CHUNK 256
#endif

/* Streaming block and prefetch distance, in elements (measured: 512/1024 beat
 * 1024-4096/2048-8192 by 10-30% on the fp16/bf16 conversions). ZK_CHUNK,
 * ZK_BLOCK and ZK_PF can be set with CGO_CFLAGS=-DZK_BLOCK=... to tune. */
#ifndef ZK_BLOCK
#define ZK_BLOCK 512
#endif
#ifndef ZK_PF
#define ZK_PF 1024
#endif

static int zk_size(int dtype) { return dtype == ZERO_F32 ? 4 : 2; }

/* Per-CPU tuning, chosen once with the ISA level (zk_tune_for_cpu) and read
 * with relaxed loads. Neither changes any result, only how memory is moved.
 *  zk_swpf:   software prefetch in the streaming kernels and the reductions.
 *             Zen 4 pays for it (accumulate 0.7-0.8x its yardstick with it,
 *             0.9-1.0x without); Zen 3 needs it for the bf16 reduction (0.8x
 *             with it, 0.6-0.7x without, measured with the chunked kernel
 *             before the one-pass one), as Intel does for the conversions.
 *             Off on AMD CPUs with AVX-512, Zen 4 and later.
 *  zk_chunk:  the reductions' chunk, at most ZK_CHUNK. With 8 ranks, 256
 *             elements fall behind on Zen 3 and 4; 128 keeps up.
 *  zk_ntcopy: a bit copy of at least ZK_NT_MIN bytes uses non-temporal stores
 *             instead of memcpy: glibc reads the L3 size a VM reports (256-320
 *             MiB on the Zen VMs measured) and then never streams. Smaller
 *             copies keep memcpy, so a small bucket stays in cache for its
 *             reduction. On AMD. */
#define ZK_NT_MIN (1 << 20)
static int zk_swpf = 1, zk_chunk = ZK_CHUNK, zk_ntcopy = 0;

static void zk_tune_for_cpu(void) {
#if ZK_MULTI
	__builtin_cpu_init();
	int amd = __builtin_cpu_is("amd"), avx512 = __builtin_cpu_supports("avx512f");
#else
	int amd = 0, avx512 = 0;
#endif
	__atomic_store_n(&zk_swpf, !(amd && avx512), __ATOMIC_RELAXED);
	__atomic_store_n(&zk_chunk, amd ? 128 : ZK_CHUNK, __ATOMIC_RELAXED);
	__atomic_store_n(&zk_ntcopy, amd, __ATOMIC_RELAXED);
}

#define ZK_AT(p, dtype, i) ((void*)((char*)(p) + (i) * (int64_t)zk_size(dtype)))
#define ZK_CAT(p, dtype, i) ((const void*)((const char*)(p) + (i) * (int64_t)zk_size(dtype)))

static inline int64_t zk_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* Prefetch elements [a, b) of an array of elements of size bytes (never
 * faults, so a range past the end would be harmless; callers clip it anyway). */
ZK_INLINE void zk_prefetch(const void* p, int size, int64_t a, int64_t b, int write) {
	if (!__atomic_load_n(&zk_swpf, __ATOMIC_RELAXED)) return;
	const char* c = (const char*)p;
	for (int64_t o = a * size; o < b * size; o += 64) {
		if (write)
			__builtin_prefetch(c + o, 1, 3);
		else
			__builtin_prefetch(c + o, 0, 3);
	}
}

/* ---- loop bodies (inlined into every level's functions) --------------------- */

/* dst[i] = cast(load(src, i) * scale) */
ZK_INLINE void zk_conv_loop(void* restrict dst, int dt, const void* restrict src, int st, float scale, int doscale,
                            int64_t n) {
	for (int64_t i = 0; i < n; i++) {
		float v = zero_load(src, st, i);
		if (doscale) v = v * scale;
		zero_store(dst, dt, i, v);
	}
}

#define ZK_CONV_CASE(D, S)                                                                                       \
	case (D) * 4 + (S):                                                                                      \
		if (doscale)                                                                                     \
			zk_conv_loop(dst, D, src, S, scale, 1, n);                                               \
		else                                                                                             \
			zk_conv_loop(dst, D, src, S, 1.0f, 0, n);                                                \
		break;

#define ZK_CONV_SWITCH                                                                                           \
	switch (dt * 4 + st) {                                                                                   \
		ZK_CONV_CASE(ZERO_F32, ZERO_F32)                                                                 \
		ZK_CONV_CASE(ZERO_F32, ZERO_BF16)                                                                \
		ZK_CONV_CASE(ZERO_F32, ZERO_F16)                                                                 \
		ZK_CONV_CASE(ZERO_BF16, ZERO_F32)                                                                \
		ZK_CONV_CASE(ZERO_BF16, ZERO_BF16)                                                               \
		ZK_CONV_CASE(ZERO_BF16, ZERO_F16)                                                                \
		ZK_CONV_CASE(ZERO_F16, ZERO_F32)                                                                 \
		ZK_CONV_CASE(ZERO_F16, ZERO_BF16)                                                                \
		ZK_CONV_CASE(ZERO_F16, ZERO_F16)                                                                 \
	default:                                                                                                 \
		break;                                                                                           \
	}

/* acc[i] = first ? v : acc[i] + v with v = load(src, i) * scale; returns
 * nonzero if a result is inf or NaN (an OR-reduction, which vectorises). */
ZK_INLINE uint32_t zk_acc_loop(float* restrict acc, const void* restrict src, int st, float scale, int doscale,
                               int first, int64_t n) {
	uint32_t bad = 0;
	for (int64_t i = 0; i < n; i++) {
		float v = zero_load(src, st, i);
		if (doscale) v = v * scale;
		float r = zero_accum(acc[i], v, first);
		acc[i] = r;
		bad |= (uint32_t)((zero_f2u(r) & 0x7f800000u) == 0x7f800000u);
	}
	return bad;
}

#define ZK_ACC_CASE(S)                                                                                           \
	case S:                                                                                                  \
		if (doscale)                                                                                     \
			return first ? zk_acc_loop(acc, src, S, scale, 1, 1, n)                                  \
			             : zk_acc_loop(acc, src, S, scale, 1, 0, n);                                 \
		return first ? zk_acc_loop(acc, src, S, 1.0f, 0, 1, n) : zk_acc_loop(acc, src, S, 1.0f, 0, 0, n);

#define ZK_ACC_SWITCH                                                                                            \
	switch (st) {                                                                                            \
		ZK_ACC_CASE(ZERO_F32)                                                                            \
		ZK_ACC_CASE(ZERO_BF16)                                                                           \
		ZK_ACC_CASE(ZERO_F16)                                                                            \
	default:                                                                                                 \
		return 0;                                                                                        \
	}

/* The same into a 16-bit accumulator of dtype at: the sum is formed in fp32
 * and rounded once; returns nonzero if a stored value is inf or NaN, so an
 * fp16 sum that rounds past 65504 raises it. */
ZK_INLINE uint32_t zk_acc16_loop(uint16_t* restrict acc, int at, const void* restrict src, int st, float scale,
                                 int doscale, int first, int64_t n) {
	const uint32_t top = at == ZERO_BF16 ? 0x7f80u : 0x7c00u; /* exponent all ones: inf or NaN */
	uint32_t bad = 0;
	for (int64_t i = 0; i < n; i++) {
		float v = zero_load(src, st, i);
		if (doscale) v = v * scale;
		float r = zero_accum(zero_load(acc, at, i), v, first);
		uint32_t h = at == ZERO_BF16 ? zero_f32_to_bf16(r) : zero_f32_to_f16(r);
		acc[i] = (uint16_t)h;
		bad |= (uint32_t)((h & top) == top);
	}
	return bad;
}

#define ZK_ACC16_CASE(A, S)                                                                                      \
	case S:                                                                                                  \
		if (doscale)                                                                                     \
			return first ? zk_acc16_loop(acc, A, src, S, scale, 1, 1, n)                             \
			             : zk_acc16_loop(acc, A, src, S, scale, 1, 0, n);                            \
		return first ? zk_acc16_loop(acc, A, src, S, 1.0f, 0, 1, n) : zk_acc16_loop(acc, A, src, S, 1.0f, 0, 0, n);

/* One switch per accumulator dtype, each function flattened: past gcc's
 * unit-wide inlining budget the fp16 rounding stayed a call, and these
 * loops ran scalar (3.5x slower for fp16 at x86-64-v2). */
#define ZK_ACC16_SWITCH(A)                                                                                       \
	switch (st) {                                                                                            \
		ZK_ACC16_CASE(A, ZERO_F32)                                                                       \
		ZK_ACC16_CASE(A, ZERO_BF16)                                                                      \
		ZK_ACC16_CASE(A, ZERO_F16)                                                                       \
	default:                                                                                                 \
		return 0;                                                                                        \
	}

/* Sum of squares: element i goes to lane i % ZK_LANES; lanes are added in a
 * fixed tree at the end. */
#define ZK_LANES 16

ZK_INLINE void zk_sumsq_lanes(double* restrict s, const float* restrict p, int64_t n) {
	int64_t i = 0;
	for (; i + ZK_LANES <= n; i += ZK_LANES) {
		for (int k = 0; k < ZK_LANES; k++) {
			double d = (double)p[i + k];
			s[k] += d * d;
		}
	}
	for (; i < n; i++) {
		double d = (double)p[i];
		s[i % ZK_LANES] += d * d;
	}
}

/* t[i] = load(src, i) */
ZK_INLINE void zk_load_loop(float* restrict t, const void* restrict src, int dt, int64_t n) {
	for (int64_t i = 0; i < n; i++) t[i] = zero_load(src, dt, i);
}

/* t[i] = combine(op, t[i], load(src, i)) */
ZK_INLINE void zk_combine_loop(float* restrict t, const void* restrict src, int dt, int op, int64_t n) {
	for (int64_t i = 0; i < n; i++) t[i] = zero_op_combine(op, t[i], zero_load(src, dt, i));
}

/* dst[i] = cast(finish(op, t[i], nr)) */
ZK_INLINE void zk_store_loop(void* restrict dst, int dt, const float* restrict t, int op, int nr, int64_t n) {
	for (int64_t i = 0; i < n; i++) zero_store(dst, dt, i, zero_op_finish(op, t[i], nr));
}

#define ZK_COMBINE_CASE(D)                                                                                       \
	case D:                                                                                                  \
		if (op == ZERO_MAX)                                                                              \
			zk_combine_loop(t, src, D, ZERO_MAX, n);                                                 \
		else                                                                                             \
			zk_combine_loop(t, src, D, ZERO_SUM, n);                                                 \
		break;

#define ZK_COMBINE_SWITCH                                                                                        \
	switch (dt) {                                                                                            \
		ZK_COMBINE_CASE(ZERO_F32)                                                                        \
		ZK_COMBINE_CASE(ZERO_BF16)                                                                       \
		ZK_COMBINE_CASE(ZERO_F16)                                                                        \
	default:                                                                                                 \
		break;                                                                                           \
	}

#define ZK_STORE_CASE(D)                                                                                         \
	case D:                                                                                                  \
		if (op == ZERO_AVG)                                                                              \
			zk_store_loop(dst, D, t, ZERO_AVG, nr, n);                                               \
		else                                                                                             \
			zk_store_loop(dst, D, t, ZERO_SUM, nr, n);                                               \
		break;

/* ---- one copy of the hot functions per ISA level ------------------------------ */

/* ZK_F16C: 0 = fp16 through the bit code of elementwise.h; 1 = F16C
 * (vcvtph2ps/vcvtps2ph, 8 lanes); 2 = also their AVX-512 forms (16 lanes).
 * The instructions round to nearest even (fixed by the immediate, not
 * MXCSR), handle fp16 subnormals, overflow to inf and quieten NaNs keeping
 * the top payload bits: the rules elementwise.h implements, so the bits are
 * the same; the tests check every level against one reference, and against
 * each other bit for bit, NaN payloads included. */
#define ZK_TEMPLATE 1
#define ZK_FN(name) name##_v2
#define ZK_TARGET
#define ZK_F16C 0
#include "kernels.c"
#undef ZK_FN
#undef ZK_TARGET
#undef ZK_F16C

#if ZK_MULTI
#define ZK_FN(name) name##_v3
#define ZK_TARGET ZK_TARGET_V3
#define ZK_F16C 1
#include "kernels.c"
#undef ZK_FN
#undef ZK_TARGET
#undef ZK_F16C

#define ZK_FN(name) name##_v4
#define ZK_TARGET ZK_TARGET_V4
#define ZK_F16C 2
#include "kernels.c"
#undef ZK_FN
#undef ZK_TARGET
#undef ZK_F16C
#endif

/* ---- level selection ------------------------------------------------------------ */

static int zk_cpu_level(void) {
#if ZK_MULTI
	__builtin_cpu_init();
	int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
	         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
#if !defined(__clang__)
	/* every AVX2 CPU has F16C, but a hypervisor may hide it; clang's list of
	 * feature names may not have it, so only gcc checks */
	v3 = v3 && __builtin_cpu_supports("f16c");
#endif
	int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
	if (v4) return 2;
	if (v3) return 1;
#endif
	return 0;
}

static int zk_level = -1; /* accessed atomically; -1 until first use */

static int zk_get_level(void) {
	int l = __atomic_load_n(&zk_level, __ATOMIC_RELAXED);
	if (l < 0) {
		zk_tune_for_cpu();
		l = zk_cpu_level();
		__atomic_store_n(&zk_level, l, __ATOMIC_RELAXED);
	}
	return l;
}

int zero_set_kernel_tuning(int swpf, int chunk, int ntcopy) {
	zk_get_level(); /* the CPU's choice first, so it does not overwrite these later */
	if (swpf < 0 || chunk < 0 || ntcopy < 0) {
		zk_tune_for_cpu();
	} else {
		__atomic_store_n(&zk_swpf, swpf != 0, __ATOMIC_RELAXED);
		__atomic_store_n(&zk_chunk, chunk < 16 ? 16 : chunk > ZK_CHUNK ? ZK_CHUNK : chunk, __ATOMIC_RELAXED);
		__atomic_store_n(&zk_ntcopy, ntcopy != 0, __ATOMIC_RELAXED);
	}
	return __atomic_load_n(&zk_swpf, __ATOMIC_RELAXED) | __atomic_load_n(&zk_chunk, __ATOMIC_RELAXED) << 1 |
	       __atomic_load_n(&zk_ntcopy, __ATOMIC_RELAXED) << 16;
}

int zero_kernel_level(void) { return zk_get_level(); }

int zero_set_kernel_level(int level) {
	int max = zk_cpu_level();
	if (level < 0 || level > max) level = max;
	__atomic_store_n(&zk_level, level, __ATOMIC_RELAXED);
	return level;
}

#if ZK_MULTI
#define ZK_DISPATCH(name, ...)                                                                                   \
	switch (zk_get_level()) {                                                                                \
	case 2: name##_v4(__VA_ARGS__); break;                                                                   \
	case 1: name##_v3(__VA_ARGS__); break;                                                                   \
	default: name##_v2(__VA_ARGS__); break;                                                                  \
	}
#define ZK_DISPATCH_RET(name, ...)                                                                               \
	switch (zk_get_level()) {                                                                                \
	case 2: return name##_v4(__VA_ARGS__);                                                                   \
	case 1: return name##_v3(__VA_ARGS__);                                                                   \
	default: return name##_v2(__VA_ARGS__);                                                                  \
	}
#else
#define ZK_DISPATCH(name, ...) name##_v2(__VA_ARGS__)
#define ZK_DISPATCH_RET(name, ...) return name##_v2(__VA_ARGS__)
#endif

/* ---- public kernels ------------------------------------------------------------- */

void zero_flatten(void* dst, int dst_dtype, const zero_seg* segs, int nseg, int src_dtype, float scale,
                  int64_t lo, int64_t hi) {
	for (int s = 0; s < nseg; s++) {
		int64_t off = segs[s].offset;
		int64_t a = off > lo ? off : lo;
		int64_t b = zk_min(off + segs[s].count, hi);
		if (a >= b) continue;
		ZK_DISPATCH(zk_conv, ZK_AT(dst, dst_dtype, a), dst_dtype, ZK_CAT(segs[s].ptr, src_dtype, a - off),
		            src_dtype, scale, b - a)
	}
}

void zero_cast(void* dst, int dst_dtype, const void* src, int src_dtype, float scale, int64_t lo, int64_t hi) {
	if (lo >= hi) return;
	ZK_DISPATCH(zk_conv, ZK_AT(dst, dst_dtype, lo), dst_dtype, ZK_CAT(src, src_dtype, lo), src_dtype, scale,
	            hi - lo)
}

/* The part [a, b) of range r that lies in [lo, hi); 0 when none. */
static int zk_clip_range(const zero_opt_range* r, int64_t lo, int64_t hi, int64_t* a, int64_t* b) {
	*a = r->offset > lo ? r->offset : lo;
	*b = zk_min(r->offset + r->count, hi);
	return *a < *b;
}

void zero_adamw(float* p, float* m, float* v, float* vmax, const float* g, void* out, int out_dtype,
                const zero_opt_range* ranges, int nr, float gscale, int64_t lo, int64_t hi) {
	for (int k = 0; k < nr; k++) {
		int64_t a, b;
		if (!zk_clip_range(&ranges[k], lo, hi, &a, &b)) continue;
		ZK_DISPATCH(zk_adamw, p, m, v, vmax, g, out, out_dtype, ranges[k], gscale, a, b)
	}
}

void zero_sgd(float* p, float* buf, const float* g, void* out, int out_dtype, const zero_opt_range* ranges, int nr,
              float gscale, int64_t lo, int64_t hi) {
	for (int k = 0; k < nr; k++) {
		int64_t a, b;
		if (!zk_clip_range(&ranges[k], lo, hi, &a, &b)) continue;
		ZK_DISPATCH(zk_sgd, p, buf, g, out, out_dtype, ranges[k], gscale, a, b)
	}
}

void zero_unflatten(const void* flat, int dtype, const zero_seg* segs, int nseg, int64_t lo, int64_t hi) {
	for (int s = 0; s < nseg; s++) {
		int64_t off = segs[s].offset;
		int64_t a = off > lo ? off : lo;
		int64_t b = zk_min(off + segs[s].count, hi);
		if (a >= b) continue;
		ZK_DISPATCH(zk_conv, ZK_AT(segs[s].ptr, dtype, a - off), dtype, ZK_CAT(flat, dtype, a), dtype, 1.0f, b - a)
	}
}

static uint32_t zk_acc_any(void* acc, int at, const void* src, int st, int first, float scale, int64_t n) {
	if (at == ZERO_F32) {
		ZK_DISPATCH_RET(zk_acc, (float*)acc, src, st, first, scale, n)
	}
	ZK_DISPATCH_RET(zk_acc16, (uint16_t*)acc, at, src, st, first, scale, n)
}

void zero_accumulate(void* acc, int acc_dtype, const zero_seg* segs, int nseg, int src_dtype, int first, float scale,
                     float* flag, int64_t lo, int64_t hi) {
	if (acc_dtype != ZERO_F32 && acc_dtype != ZERO_BF16 && acc_dtype != ZERO_F16) return;
	uint32_t bad = 0;
	for (int s = 0; s < nseg; s++) {
		int64_t off = segs[s].offset;
		int64_t a = off > lo ? off : lo;
		int64_t b = zk_min(off + segs[s].count, hi);
		if (a >= b) continue;
		bad |= zk_acc_any(ZK_AT(acc, acc_dtype, a), acc_dtype, ZK_CAT(segs[s].ptr, src_dtype, a - off), src_dtype,
		                  first != 0, scale, b - a);
	}
	if (bad && flag) *flag = 1.0f;
}

/* The sum of squares of one chunk x[0..n) of dtype dt (n <= ZERO_NORM_CHUNK):
 * a 16-bit chunk is widened into a buffer on the stack first (exact), so
 * every dtype goes through zero_sumsq's lanes the same way. */
static double zk_chunk_sumsq(const void* x, int dt, int64_t n) {
	if (dt == ZERO_F32) return zero_sumsq((const float*)x, 0, n);
	float wide[ZERO_NORM_CHUNK];
	ZK_DISPATCH(zk_conv, wide, ZERO_F32, x, dt, 1.0f, n)
	return zero_sumsq(wide, 0, n);
}

void zero_chunk_squares(const void* x, int dtype, int64_t origin, int64_t lo, int64_t hi, double* sums) {
	for (int64_t c = lo; c < hi; c += ZERO_NORM_CHUNK) {
		int64_t e = zk_min(c + ZERO_NORM_CHUNK, hi);
		sums[(c - origin) / ZERO_NORM_CHUNK] = zk_chunk_sumsq(ZK_CAT(x, dtype, c), dtype, e - c);
	}
}

void zero_accumulate_squares(void* acc, int acc_dtype, const zero_seg* seg, int src_dtype, int first, float scale,
                             float* flag, int64_t lo, int64_t hi, double* sums) {
	if (acc_dtype != ZERO_F32 && acc_dtype != ZERO_BF16 && acc_dtype != ZERO_F16) return;
	uint32_t bad = 0;
	for (int64_t c = lo; c < hi; c += ZERO_NORM_CHUNK) {
		int64_t e = zk_min(c + ZERO_NORM_CHUNK, hi);
		bad |= zk_acc_any(ZK_AT(acc, acc_dtype, c), acc_dtype, ZK_CAT(seg->ptr, src_dtype, c - seg->offset),
		                  src_dtype, first != 0, scale, e - c);
		/* read back while the chunk is still in cache */
		sums[(c - seg->offset) / ZERO_NORM_CHUNK] = zk_chunk_sumsq(ZK_CAT(acc, acc_dtype, c), acc_dtype, e - c);
	}
	if (bad && flag) *flag = 1.0f;
}

double zero_sumsq(const float* x, int64_t lo, int64_t hi) {
	if (lo >= hi) return 0.0;
	ZK_DISPATCH_RET(zk_sumsq, x + lo, hi - lo)
}

void zero_reduce(void* dst, const uintptr_t* srcs, int n, int dtype, int op, int64_t lo, int64_t hi) {
	if (n <= 0 || lo >= hi) return;
	ZK_DISPATCH(zk_reduce, dst, srcs, n, dtype, op, lo, hi)
}

void zero_allreduce_fused(const uintptr_t* bufs, int n, int dtype, int op, int64_t lo, int64_t hi) {
	if (n <= 0 || lo >= hi) return;
	ZK_DISPATCH(zk_allreduce, bufs, n, dtype, op, lo, hi)
}

/* ---- benchmark yardsticks (baseline ISA only) -------------------------------- */

/* Plain loops with plain stores. gcc would turn the copy loops into calls to
 * memcpy, and glibc's memcpy uses non-temporal stores at these sizes, which
 * skip reading the destination before writing it: fewer bytes moved than the
 * loop asks for, and than any kernel here moves. */
#if defined(__GNUC__) && !defined(__clang__)
#define ZK_YARD __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define ZK_YARD
#endif

ZK_YARD void zero_yard_copy16(uint16_t* restrict dst, const uint16_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = src[i];
}

ZK_YARD void zero_yard_copy32(uint32_t* restrict dst, const uint32_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = src[i];
}

ZK_YARD void zero_yard_widen(uint32_t* restrict dst, const uint16_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = src[i];
}

ZK_YARD void zero_yard_narrow(uint16_t* restrict dst, const uint32_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = (uint16_t)(src[i] >> 16);
}

ZK_YARD void zero_yard_add32(float* restrict acc, const float* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) acc[i] += src[i];
}

ZK_YARD void zero_yard_add16(float* restrict acc, const uint16_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) acc[i] += (float)src[i];
}

ZK_YARD void zero_yard_add16x16(uint16_t* restrict acc, const uint16_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) acc[i] = (uint16_t)(acc[i] + src[i]);
}

ZK_YARD uint32_t zero_yard_read32(const uint32_t* restrict x, int64_t lo, int64_t hi) {
	uint32_t s = 0;
	for (int64_t i = lo; i < hi; i++) s ^= x[i];
	return s;
}

ZK_YARD void zero_yard_sum4_32(float* restrict dst, const float* restrict a, const float* restrict b, const float* restrict c,
                       const float* restrict d, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = a[i] + b[i] + c[i] + d[i];
}

ZK_YARD void zero_yard_sum4_16(uint16_t* restrict dst, const uint16_t* restrict a, const uint16_t* restrict b,
                       const uint16_t* restrict c, const uint16_t* restrict d, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = (uint16_t)(a[i] + b[i] + c[i] + d[i]);
}

ZK_YARD void zero_yard_inc32(float* restrict x, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) x[i] += 1.0f;
}

ZK_YARD void zero_yard_optpass(uint16_t* restrict out, float* restrict p, const float* restrict g, float* restrict m,
                               float* restrict v, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) {
		float x = p[i] + g[i];
		p[i] = x;
		m[i] += g[i];
		v[i] += g[i];
		out[i] = (uint16_t)(zero_f2u(x) >> 16);
	}
}

ZK_YARD void zero_yard_allsum4_32(float* restrict a, float* restrict b, float* restrict c, float* restrict d, int64_t lo,
                          int64_t hi) {
	for (int64_t i = lo; i < hi; i++) {
		float s = a[i] + b[i] + c[i] + d[i];
		a[i] = s;
		b[i] = s;
		c[i] = s;
		d[i] = s;
	}
}

/* ---- streaming copy ------------------------------------------------------------ */

/* Copies with non-temporal stores where the ISA has them: a copy into memory
 * that is not in cache would otherwise read every destination line before
 * writing it (read-for-ownership), moving 3 bytes per byte copied instead of
 * 2. The in-process group's all-gather and broadcast use it. */
void zero_copy_stream(void* dst, const void* src, int64_t bytes) {
	char* d = (char*)dst;
	const char* s = (const char*)src;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
	if (bytes >= 4096) {
		int64_t head = (int64_t)((16 - ((uintptr_t)d & 15)) & 15);
		memcpy(d, s, (size_t)head);
		d += head, s += head, bytes -= head;
		int64_t n = bytes / 64;
		for (int64_t i = 0; i < n; i++, d += 64, s += 64) {
			__m128i a = _mm_loadu_si128((const __m128i*)s), b = _mm_loadu_si128((const __m128i*)(s + 16));
			__m128i c = _mm_loadu_si128((const __m128i*)(s + 32)), e = _mm_loadu_si128((const __m128i*)(s + 48));
			_mm_stream_si128((__m128i*)d, a);
			_mm_stream_si128((__m128i*)(d + 16), b);
			_mm_stream_si128((__m128i*)(d + 32), c);
			_mm_stream_si128((__m128i*)(d + 48), e);
		}
		bytes -= n * 64;
		_mm_sfence();
	}
#endif
	memcpy(d, s, (size_t)bytes);
}

#else /* ZK_TEMPLATE: the hot functions of one ISA level, named ZK_FN(name) */

#if ZK_F16C
/* fp16 -> fp32 with the F16C instructions; the tail with elementwise.h. */
ZK_TARGET static void ZK_FN(zk_h2f)(float* restrict d, const uint16_t* restrict s, int64_t n) {
	int64_t i = 0;
#if ZK_F16C >= 2
	for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
#endif
	for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
	for (; i < n; i++) d[i] = zero_f16_to_f32(s[i]);
}

/* d[i] = fp16(s[i] * scale), the multiply skipped when scale == 1. */
ZK_TARGET static void ZK_FN(zk_f2h)(uint16_t* restrict d, const float* restrict s, float scale, int64_t n) {
	int doscale = scale != 1.0f;
	int64_t i = 0;
#if ZK_F16C >= 2
	__m512 s16 = _mm512_set1_ps(scale);
	for (; i + 16 <= n; i += 16) {
		__m512 v = _mm512_loadu_ps(s + i);
		if (doscale) v = _mm512_mul_ps(v, s16);
		_mm256_storeu_si256((__m256i*)(d + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
	}
#endif
	__m256 s8 = _mm256_set1_ps(scale);
	for (; i + 8 <= n; i += 8) {
		__m256 v = _mm256_loadu_ps(s + i);
		if (doscale) v = _mm256_mul_ps(v, s8);
		_mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
	}
	for (; i < n; i++) {
		float v = s[i];
		if (doscale) v = v * scale;
		d[i] = zero_f32_to_f16(v);
	}
}
#endif

#if ZK_F16C
/* d[i] = bf16(load(s, i) * scale) for an fp32 or bf16 source, the rounding of
 * zero_f32_to_bf16 in vector integer ops: gcc's vectorisation of the scalar
 * form runs 10-20% under a plain copy here. */
ZK_TARGET static void ZK_FN(zk_to_bf16)(uint16_t* restrict d, const void* restrict s, int st, float scale,
                                        int64_t n) {
	int doscale = scale != 1.0f;
	int64_t i = 0;
#if ZK_F16C >= 2
	const __m512 vs = _mm512_set1_ps(scale);
	const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), abs = _mm512_set1_epi32(0x7fffffff),
	              inf = _mm512_set1_epi32(0x7f800000), quiet = _mm512_set1_epi32(0x40);
	for (; i + 16 <= n; i += 16) {
		__m512 v = st == ZERO_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
		                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)s + i))), 16))
		                           : _mm512_loadu_ps((const float*)s + i);
		if (doscale) v = _mm512_mul_ps(v, vs);
		__m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
		__mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
		__m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(hi, one))), 16);
		r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, quiet));
		_mm256_storeu_si256((__m256i*)(d + i), _mm512_cvtepi32_epi16(r));
	}
#endif
	const __m256 vs8 = _mm256_set1_ps(scale);
	const __m256i one8 = _mm256_set1_epi32(1), bias8 = _mm256_set1_epi32(0x7fff), abs8 = _mm256_set1_epi32(0x7fffffff),
	              inf8 = _mm256_set1_epi32(0x7f800000), quiet8 = _mm256_set1_epi32(0x40);
	for (; i + 8 <= n; i += 8) {
		__m256 v = st == ZERO_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
		                                 _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)s + i))), 16))
		                           : _mm256_loadu_ps((const float*)s + i);
		if (doscale) v = _mm256_mul_ps(v, vs8);
		__m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
		__m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs8), inf8);
		__m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias8, _mm256_and_si256(hi, one8))), 16);
		r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet8), nan);
		__m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* values fit 16 bits */
		_mm_storeu_si128((__m128i*)(d + i), _mm256_castsi256_si128(p));
	}
	for (; i < n; i++) {
		float v = zero_load(s, st, i);
		if (doscale) v = v * scale;
		d[i] = zero_f32_to_bf16(v);
	}
}

/* one block of dst[i] = cast(load(src, i) * scale) through the generic loops */
ZK_TARGET static void ZK_FN(zk_conv_block)(void* restrict dst, int dt, const void* restrict src, int st,
                                           float scale, int64_t n) {
	int doscale = scale != 1.0f;
	ZK_CONV_SWITCH
}
#endif

/* dst[i] = cast(load(src, i) * scale), i in [0, n); dst and src already offset. */
ZK_TARGET static void ZK_FN(zk_conv)(void* restrict dst0, int dt, const void* restrict src0, int st, float scale,
                                     int64_t total) {
	int doscale = scale != 1.0f;
	if (dt == st && !doscale) { /* a bit copy (elementwise.h, zero_copy_elem) */
		int64_t bytes = total * zk_size(dt);
		if (bytes >= ZK_NT_MIN && __atomic_load_n(&zk_ntcopy, __ATOMIC_RELAXED))
			zero_copy_stream(dst0, src0, bytes);
		else
			memcpy(dst0, src0, (size_t)bytes);
		return;
	}
	for (int64_t i = 0; i < total; i += ZK_BLOCK) {
		int64_t n = zk_min(ZK_BLOCK, total - i);
		int64_t pa = i + ZK_PF, pb = zk_min(pa + n, total);
		zk_prefetch(src0, zk_size(st), pa, pb, 0);
		zk_prefetch(dst0, zk_size(dt), pa, pb, 1);
		void* restrict dst = ZK_AT(dst0, dt, i);
		const void* restrict src = ZK_CAT(src0, st, i);
#if ZK_F16C
		if (dt == ZERO_BF16 && st != ZERO_F16) {
			ZK_FN(zk_to_bf16)((uint16_t*)dst, src, st, scale, n);
			continue;
		}
		if (st == ZERO_F16 || dt == ZERO_F16) {
			/* through an fp32 block in L1: hardware fp16 on either side */
			float t[ZK_BLOCK] __attribute__((aligned(64)));
			if (st == ZERO_F16)
				ZK_FN(zk_h2f)(t, (const uint16_t*)src, n);
			else
				ZK_FN(zk_conv_block)(t, ZERO_F32, src, st, 1.0f, n);
			if (dt == ZERO_F16)
				ZK_FN(zk_f2h)((uint16_t*)dst, t, scale, n);
			else
				ZK_FN(zk_conv_block)(dst, dt, t, ZERO_F32, scale, n);
			continue;
		}
#endif
		ZK_CONV_SWITCH
	}
}

ZK_TARGET static uint32_t ZK_FN(zk_acc_block)(float* restrict acc, const void* restrict src, int st, int first,
                                              float scale, int doscale, int64_t n) {
	ZK_ACC_SWITCH
}

/* copy-vs-add of n elements; returns nonzero if a result is not finite */
ZK_TARGET static uint32_t ZK_FN(zk_acc)(float* restrict acc, const void* restrict src, int st, int first,
                                        float scale, int64_t total) {
	int doscale = scale != 1.0f;
	uint32_t bad = 0;
	for (int64_t i = 0; i < total; i += ZK_BLOCK) {
		int64_t n = zk_min(ZK_BLOCK, total - i);
		int64_t pa = i + ZK_PF, pb = zk_min(pa + n, total);
		zk_prefetch(src, zk_size(st), pa, pb, 0);
		zk_prefetch(acc, 4, pa, pb, 1);
#if ZK_F16C
		if (st == ZERO_F16) {
			float t[ZK_BLOCK] __attribute__((aligned(64)));
			ZK_FN(zk_h2f)(t, (const uint16_t*)src + i, n);
			bad |= ZK_FN(zk_acc_block)(acc + i, t, ZERO_F32, first, scale, doscale, n);
			continue;
		}
#endif
		bad |= ZK_FN(zk_acc_block)(acc + i, ZK_CAT(src, st, i), st, first, scale, doscale, n);
	}
	return bad;
}

ZK_TARGET static double ZK_FN(zk_sumsq)(const float* restrict p, int64_t total) {
	double s[ZK_LANES];
	for (int k = 0; k < ZK_LANES; k++) s[k] = 0.0;
	/* blocks are multiples of ZK_LANES, so lane = index % ZK_LANES throughout */
	for (int64_t i = 0; i < total; i += ZK_BLOCK) {
		int64_t n = zk_min(ZK_BLOCK, total - i);
		int64_t pa = i + ZK_PF, pb = zk_min(pa + n, total);
		zk_prefetch(p, 4, pa, pb, 0);
		zk_sumsq_lanes(s, p + i, n);
	}
	for (int w = ZK_LANES / 2; w > 0; w /= 2)
		for (int k = 0; k < w; k++) s[k] = s[k] + s[k + w];
	return s[0];
}

ZK_TARGET static void ZK_FN(zk_load)(float* restrict t, const void* restrict src, int dt, int64_t n) {
#if ZK_F16C
	if (dt == ZERO_F16) {
		ZK_FN(zk_h2f)(t, (const uint16_t*)src, n);
		return;
	}
#endif
	switch (dt) {
	case ZERO_F32: zk_load_loop(t, src, ZERO_F32, n); break;
	case ZERO_BF16: zk_load_loop(t, src, ZERO_BF16, n); break;
	case ZERO_F16: zk_load_loop(t, src, ZERO_F16, n); break;
	default: break;
	}
}

ZK_TARGET static void ZK_FN(zk_combine)(float* restrict t, const void* restrict src, int dt, int op, int64_t n) {
#if ZK_F16C
	if (dt == ZERO_F16) {
		float x[ZK_CHUNK] __attribute__((aligned(64)));
		ZK_FN(zk_h2f)(x, (const uint16_t*)src, n);
		src = x;
		dt = ZERO_F32;
		ZK_COMBINE_SWITCH
		return;
	}
#endif
	ZK_COMBINE_SWITCH
}

ZK_TARGET static void ZK_FN(zk_store)(void* restrict dst, int dt, const float* restrict t, int op, int nr,
                                      int64_t n) {
#if ZK_F16C
	if (dt == ZERO_F16) {
		float x[ZK_CHUNK] __attribute__((aligned(64)));
		if (op == ZERO_AVG) {
			for (int64_t i = 0; i < n; i++) x[i] = zero_op_finish(ZERO_AVG, t[i], nr);
			t = x;
		}
		ZK_FN(zk_f2h)((uint16_t*)dst, t, 1.0f, n);
		return;
	}
#endif
	switch (dt) {
		ZK_STORE_CASE(ZERO_F32)
		ZK_STORE_CASE(ZERO_BF16)
		ZK_STORE_CASE(ZERO_F16)
	default:
		break;
	}
}

#if ZK_F16C
/* The 16-bit accumulator in one fused vector loop: load and widen both
 * operands, scale, add, round once (F16C for fp16; bf16 with zk_to_bf16's
 * integer ops), test the rounded bits, store. ZK_VL lanes; the caller does
 * the tail. Faster than passes over fp32 blocks in L1 (fp16 2x, bf16 up to
 * 1.2x, one core). */
#if ZK_F16C >= 2
#define ZK_VL 16
#define zk_vf __m512
#define zk_vh __m256i
#define zk_ldh(p) _mm256_loadu_si256((const __m256i*)(p))
#define zk_sth(p, h) _mm256_storeu_si256((__m256i*)(p), h)
#else
#define ZK_VL 8
#define zk_vf __m256
#define zk_vh __m128i
#define zk_ldh(p) _mm_loadu_si128((const __m128i*)(p))
#define zk_sth(p, h) _mm_storeu_si128((__m128i*)(p), h)
#endif

/* ZK_VL elements of p (dtype dt) from element i, widened to fp32 */
ZK_TARGET ZK_INLINE zk_vf ZK_FN(zk_vload)(const void* p, int dt, int64_t i) {
#if ZK_F16C >= 2
	if (dt == ZERO_F32) return _mm512_loadu_ps((const float*)p + i);
	zk_vh h = zk_ldh((const uint16_t*)p + i);
	if (dt == ZERO_F16) return _mm512_cvtph_ps(h);
	return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
	if (dt == ZERO_F32) return _mm256_loadu_ps((const float*)p + i);
	zk_vh h = zk_ldh((const uint16_t*)p + i);
	if (dt == ZERO_F16) return _mm256_cvtph_ps(h);
	return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}

/* v rounded to dtype at (bf16 or fp16), to nearest even: zero_f32_to_bf16
 * and zero_f32_to_f16 of elementwise.h, lane by lane */
ZK_TARGET ZK_INLINE zk_vh ZK_FN(zk_vnarrow)(zk_vf v, int at) {
#if ZK_F16C >= 2
	if (at == ZERO_F16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
	__m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
	__mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
	                                        _mm512_set1_epi32(0x7f800000));
	__m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
	__m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
	r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
	return _mm512_cvtepi32_epi16(r);
#else
	if (at == ZERO_F16) return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
	__m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
	__m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
	__m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
	__m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
	r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
	return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)); /* values fit 16 bits */
#endif
}

/* copy-vs-add over [0, n - n % ZK_VL); nonzero if a stored value is inf/NaN */
ZK_TARGET ZK_INLINE uint32_t ZK_FN(zk_acc16_vloop)(uint16_t* restrict acc, int at, const void* restrict src, int st,
                                                   float scale, int doscale, int first, int64_t n) {
#if ZK_F16C >= 2
	const zk_vf vs = _mm512_set1_ps(scale);
	const zk_vh top = _mm256_set1_epi16((short)(at == ZERO_BF16 ? 0x7f80 : 0x7c00));
	__mmask16 bad = 0;
#else
	const zk_vf vs = _mm256_set1_ps(scale);
	const zk_vh top = _mm_set1_epi16((short)(at == ZERO_BF16 ? 0x7f80 : 0x7c00));
	zk_vh bad = _mm_setzero_si128();
#endif
	for (int64_t i = 0; i + ZK_VL <= n; i += ZK_VL) {
		zk_vf v = ZK_FN(zk_vload)(src, st, i);
#if ZK_F16C >= 2
		if (doscale) v = _mm512_mul_ps(v, vs);
		if (!first) v = _mm512_add_ps(ZK_FN(zk_vload)(acc, at, i), v);
		zk_vh h = ZK_FN(zk_vnarrow)(v, at);
		bad |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, top), top);
#else
		if (doscale) v = _mm256_mul_ps(v, vs);
		if (!first) v = _mm256_add_ps(ZK_FN(zk_vload)(acc, at, i), v);
		zk_vh h = ZK_FN(zk_vnarrow)(v, at);
		bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, top), top));
#endif
		zk_sth(acc + i, h);
	}
#if ZK_F16C >= 2
	return bad != 0;
#else
	return _mm_movemask_epi8(bad) != 0;
#endif
}

#define ZK_ACC16V_CASE(A, S)                                                                                     \
	case (A) * 4 + (S):                                                                                      \
		if (doscale)                                                                                     \
			return first ? ZK_FN(zk_acc16_vloop)(acc, A, src, S, scale, 1, 1, n)                     \
			             : ZK_FN(zk_acc16_vloop)(acc, A, src, S, scale, 1, 0, n);                    \
		return first ? ZK_FN(zk_acc16_vloop)(acc, A, src, S, 1.0f, 0, 1, n)                              \
		             : ZK_FN(zk_acc16_vloop)(acc, A, src, S, 1.0f, 0, 0, n);

ZK_TARGET static uint32_t ZK_FN(zk_acc16_vec)(uint16_t* restrict acc, int at, const void* restrict src, int st,
                                              int first, float scale, int doscale, int64_t n) {
	switch (at * 4 + st) {
		ZK_ACC16V_CASE(ZERO_BF16, ZERO_F32)
		ZK_ACC16V_CASE(ZERO_BF16, ZERO_BF16)
		ZK_ACC16V_CASE(ZERO_BF16, ZERO_F16)
		ZK_ACC16V_CASE(ZERO_F16, ZERO_F32)
		ZK_ACC16V_CASE(ZERO_F16, ZERO_BF16)
		ZK_ACC16V_CASE(ZERO_F16, ZERO_F16)
	default:
		return 0;
	}
}
#undef ZK_ACC16V_CASE
#undef ZK_VL
#undef zk_vf
#undef zk_vh
#undef zk_ldh
#undef zk_sth
#else
ZK_TARGET ZK_FLATTEN static uint32_t ZK_FN(zk_acc_bf16_block)(uint16_t* restrict acc, const void* restrict src, int st,
                                                              int first, float scale, int doscale, int64_t n) {
	ZK_ACC16_SWITCH(ZERO_BF16)
}

ZK_TARGET ZK_FLATTEN static uint32_t ZK_FN(zk_acc_f16_block)(uint16_t* restrict acc, const void* restrict src, int st,
                                                             int first, float scale, int doscale, int64_t n) {
	ZK_ACC16_SWITCH(ZERO_F16)
}
#endif

/* copy-vs-add of n elements into the 16-bit accumulator acc (dtype at);
 * returns nonzero if a stored value is not finite */
ZK_TARGET static uint32_t ZK_FN(zk_acc16)(uint16_t* restrict acc, int at, const void* restrict src, int st, int first,
                                          float scale, int64_t total) {
	int doscale = scale != 1.0f;
	uint32_t bad = 0;
	for (int64_t i = 0; i < total; i += ZK_BLOCK) {
		int64_t n = zk_min(ZK_BLOCK, total - i);
		int64_t pa = i + ZK_PF, pb = zk_min(pa + n, total);
		zk_prefetch(src, zk_size(st), pa, pb, 0);
		zk_prefetch(acc, 2, pa, pb, 1);
		const void* restrict s = ZK_CAT(src, st, i);
#if ZK_F16C
		bad |= ZK_FN(zk_acc16_vec)(acc + i, at, s, st, first, scale, doscale, n);
		/* the last few elements one at a time, with elementwise.h */
		const uint32_t top = at == ZERO_BF16 ? 0x7f80u : 0x7c00u;
		for (int64_t k = n - n % (ZK_F16C >= 2 ? 16 : 8); k < n; k++) {
			float v = zero_load(s, st, k);
			if (doscale) v = v * scale;
			zero_store(acc + i, at, k, zero_accum(zero_load(acc + i, at, k), v, first));
			bad |= (uint32_t)((acc[i + k] & top) == top);
		}
#else
		if (at == ZERO_BF16)
			bad |= ZK_FN(zk_acc_bf16_block)(acc + i, s, st, first, scale, doscale, n);
		else
			bad |= ZK_FN(zk_acc_f16_block)(acc + i, s, st, first, scale, doscale, n);
#endif
	}
	return bad;
}

/* ---- bf16 reductions: one pass over all ranks per vector ---------------------- */

/* The bf16 reduce and fused all-reduce read every rank's vector, widen it in
 * registers, combine in rank order and round once: no fp32 work space. The
 * chunked passes through one (zk_reduce_chunk) store and reload every partial
 * sum and run a loop per rank and chunk, and ran at 0.7-0.9x their yardstick
 * on Zen 3-5. A 32-bit lane holds two bf16: the low one widens by a shift,
 * the high one by a mask, so no shuffles are needed, and each element's
 * arithmetic is elementwise.h's (zero_bf16_to_f32, zero_op_combine,
 * zero_op_finish, zero_f32_to_bf16). GCC's vector extensions write it once
 * for the 16-, 32- and 64-byte vectors of the three levels. */
#define ZK_VB (ZK_F16C >= 2 ? 64 : ZK_F16C ? 32 : 16)
typedef uint32_t ZK_FN(zk_vu) __attribute__((vector_size(ZK_VB)));
typedef int32_t ZK_FN(zk_vi) __attribute__((vector_size(ZK_VB)));
typedef float ZK_FN(zk_vf) __attribute__((vector_size(ZK_VB)));
#define ZK_VU ZK_FN(zk_vu)
#define ZK_VI ZK_FN(zk_vi)
#define ZK_VF ZK_FN(zk_vf)

/* zero_op_combine on every lane */
ZK_TARGET ZK_INLINE ZK_VF ZK_FN(zk_vcombine)(int op, ZK_VF s, ZK_VF x) {
	if (op != ZERO_MAX) return s + x;
	ZK_VU take = (ZK_VU)((x > s) | (x != x)); /* zero_max */
	return (ZK_VF)(((ZK_VU)x & take) | ((ZK_VU)s & ~take));
}

/* zero_op_finish on every lane */
ZK_TARGET ZK_INLINE ZK_VF ZK_FN(zk_vfinish)(int op, ZK_VF s, int n) {
	if (op != ZERO_AVG) return s;
	return (n & (n - 1)) == 0 ? s * (1.0f / (float)n) : s / (float)n;
}

/* zero_f32_to_bf16 on every lane, the bf16 left in the lane's high half */
ZK_TARGET ZK_INLINE ZK_VU ZK_FN(zk_vround)(ZK_VF f) {
	ZK_VU u = (ZK_VU)f;
	ZK_VU nan = (ZK_VU)((ZK_VI)(u & 0x7fffffffu) > 0x7f800000);
	ZK_VU bias = (0x7fffu + ((u >> 16) & 1u)) & ~nan;
	return (u + bias) | (nan & 0x00400000u);
}

/* bf16(op over the n sources' elements [i, i + m), rank order, fp32) in a
 * vector, m <= ZK_VB / 2. A short m reads into zero-filled vectors, so the
 * last elements of a span take the same instructions as the rest (the lanes
 * past m are never stored). */
ZK_TARGET ZK_INLINE ZK_VU ZK_FN(zk_bf16_vec)(const uintptr_t* srcs, int n, int op, int64_t i, int64_t m) {
	ZK_VU x = {0};
	memcpy(&x, (const uint16_t*)srcs[0] + i, (size_t)m * 2);
	ZK_VF low = (ZK_VF)(x << 16), high = (ZK_VF)(x & 0xffff0000u);
	for (int r = 1; r < n; r++) {
		memcpy(&x, (const uint16_t*)srcs[r] + i, (size_t)m * 2);
		low = ZK_FN(zk_vcombine)(op, low, (ZK_VF)(x << 16));
		high = ZK_FN(zk_vcombine)(op, high, (ZK_VF)(x & 0xffff0000u));
	}
	return (ZK_FN(zk_vround)(ZK_FN(zk_vfinish)(op, low, n)) >> 16) |
	       (ZK_FN(zk_vround)(ZK_FN(zk_vfinish)(op, high, n)) & 0xffff0000u);
}

/* dsts[0..nd)[i] = bf16(op over srcs[0..n)[i]) for i in [lo, hi). Every source
 * vector is read before a destination is written, so a destination may be a
 * source. */
ZK_TARGET ZK_INLINE void ZK_FN(zk_bf16_span)(const uintptr_t* dsts, int nd, const uintptr_t* srcs, int n, int op,
                                             int64_t lo, int64_t hi) {
	int64_t i = lo;
	for (; i + ZK_VB / 2 <= hi; i += ZK_VB / 2) {
		const ZK_VU out = ZK_FN(zk_bf16_vec)(srcs, n, op, i, ZK_VB / 2);
		for (int d = 0; d < nd; d++) memcpy((uint16_t*)dsts[d] + i, &out, ZK_VB);
	}
	if (i < hi) {
		const ZK_VU out = ZK_FN(zk_bf16_vec)(srcs, n, op, i, hi - i);
		for (int d = 0; d < nd; d++) memcpy((uint16_t*)dsts[d] + i, &out, (size_t)(hi - i) * 2);
	}
}

/* zk_bf16_span with the op fixed in each loop. Where the CPU wants software
 * prefetch (zk_swpf), chunk by chunk, prefetching every source's next chunk;
 * elsewhere in one span, since each span sets up its constants again. */
ZK_TARGET static void ZK_FN(zk_reduce_bf16)(const uintptr_t* dsts, int nd, const uintptr_t* srcs, int n, int op,
                                            int64_t lo, int64_t hi) {
	const int64_t chunk =
		__atomic_load_n(&zk_swpf, __ATOMIC_RELAXED) ? __atomic_load_n(&zk_chunk, __ATOMIC_RELAXED) : hi - lo;
	for (int64_t i = lo; i < hi; i += chunk) {
		int64_t e = zk_min(i + chunk, hi);
		for (int r = 0; r < n; r++) zk_prefetch((const void*)srcs[r], 2, e, zk_min(e + chunk, hi), 0);
		switch (op) {
		case ZERO_SUM: ZK_FN(zk_bf16_span)(dsts, nd, srcs, n, ZERO_SUM, i, e); break;
		case ZERO_AVG: ZK_FN(zk_bf16_span)(dsts, nd, srcs, n, ZERO_AVG, i, e); break;
		case ZERO_MAX: ZK_FN(zk_bf16_span)(dsts, nd, srcs, n, ZERO_MAX, i, e); break;
		default: break;
		}
	}
}
#undef ZK_VB
#undef ZK_VU
#undef ZK_VI
#undef ZK_VF

/* t[0..m) = op over the n buffers' elements [i, i+m), in rank order, in fp32;
 * prefetches every buffer's next chunk [i+m, i+m+next). */
ZK_TARGET static void ZK_FN(zk_reduce_chunk)(float* restrict t, const uintptr_t* bufs, int n, int dt, int op,
                                             int64_t i, int64_t m, int64_t next) {
	for (int r = 0; r < n; r++) zk_prefetch((const void*)bufs[r], zk_size(dt), i + m, i + m + next, 0);
	ZK_FN(zk_load)(t, ZK_CAT(bufs[0], dt, i), dt, m);
	for (int r = 1; r < n; r++) ZK_FN(zk_combine)(t, ZK_CAT(bufs[r], dt, i), dt, op, m);
}

/* The fp32 sum or average of 2 to 4 sources in one pass, without the fp32
 * work space: the same adds in rank order as zk_reduce_chunk's
 * (((x0 + x1) + x2) + x3), then zero_op_finish's scaling, so the same bits.
 * Where the sources sit in cache (a reduce-scatter's parts just received)
 * the work space's passes took twice the plain loop's time (2 sources of
 * 512 KiB: 22 us against 12). dst may be one of the sources: each element is
 * read before it is written, hence ivdep. Where the CPU wants software
 * prefetch, chunk by chunk, prefetching every source's next chunk. */
#define ZK_SUM_ID(x) (x)
#define ZK_SUM_MUL(x) ((x) * inv)
#define ZK_SUM_DIV(x) ((x) / fn)
#define ZK_SUM_N(FIN)                                                                                           \
	switch (n) {                                                                                             \
	case 2:                                                                                                  \
		_Pragma("GCC ivdep") for (int64_t j = 0; j < m; j++) d[j] = FIN(a[j] + b[j]);                     \
		break;                                                                                           \
	case 3:                                                                                                  \
		_Pragma("GCC ivdep") for (int64_t j = 0; j < m; j++) d[j] = FIN(a[j] + b[j] + c[j]);              \
		break;                                                                                           \
	default:                                                                                                 \
		_Pragma("GCC ivdep") for (int64_t j = 0; j < m; j++) d[j] = FIN(a[j] + b[j] + c[j] + e[j]);       \
		break;                                                                                           \
	}

ZK_TARGET static void ZK_FN(zk_sum_f32)(float* dst, const uintptr_t* srcs, int n, int op, int64_t lo, int64_t hi) {
	const int64_t chunk =
		__atomic_load_n(&zk_swpf, __ATOMIC_RELAXED) ? __atomic_load_n(&zk_chunk, __ATOMIC_RELAXED) : hi - lo;
	const float inv = 1.0f / (float)n, fn = (float)n;
	const int pow2 = (n & (n - 1)) == 0;
	for (int64_t i = lo; i < hi; i += chunk) {
		const int64_t m = zk_min(chunk, hi - i);
		for (int r = 0; r < n; r++) zk_prefetch((const void*)srcs[r], 4, i + m, zk_min(i + m + chunk, hi), 0);
		float* d = dst + i;
		const float* a = (const float*)srcs[0] + i;
		const float* b = (const float*)srcs[1] + i;
		const float* c = n > 2 ? (const float*)srcs[2] + i : a;
		const float* e = n > 3 ? (const float*)srcs[3] + i : a;
		if (op == ZERO_SUM) {
			ZK_SUM_N(ZK_SUM_ID)
		} else if (pow2) {
			ZK_SUM_N(ZK_SUM_MUL)
		} else {
			ZK_SUM_N(ZK_SUM_DIV)
		}
	}
}
#undef ZK_SUM_N
#undef ZK_SUM_DIV
#undef ZK_SUM_MUL
#undef ZK_SUM_ID

ZK_TARGET static void ZK_FN(zk_reduce)(void* dst, const uintptr_t* srcs, int n, int dtype, int op, int64_t lo,
                                       int64_t hi) {
	if (dtype == ZERO_F32 && (op == ZERO_SUM || op == ZERO_AVG) && n >= 2 && n <= 4) {
		ZK_FN(zk_sum_f32)((float*)dst, srcs, n, op, lo, hi);
		return;
	}
	if (dtype == ZERO_BF16) {
		const uintptr_t d = (uintptr_t)dst;
		ZK_FN(zk_reduce_bf16)(&d, 1, srcs, n, op, lo, hi);
		return;
	}
	float t[ZK_CHUNK] __attribute__((aligned(64)));
	const int64_t chunk = __atomic_load_n(&zk_chunk, __ATOMIC_RELAXED);
	for (int64_t i = lo; i < hi; i += chunk) {
		int64_t m = zk_min(chunk, hi - i);
		ZK_FN(zk_reduce_chunk)(t, srcs, n, dtype, op, i, m, zk_min(chunk, hi - i - m));
		ZK_FN(zk_store)(ZK_AT(dst, dtype, i), dtype, t, op, n, m);
	}
}

ZK_TARGET static void ZK_FN(zk_allreduce)(const uintptr_t* bufs, int n, int dtype, int op, int64_t lo,
                                          int64_t hi) {
	if (dtype == ZERO_BF16) {
		ZK_FN(zk_reduce_bf16)(bufs, n, bufs, n, op, lo, hi);
		return;
	}
	float t[ZK_CHUNK] __attribute__((aligned(64)));
	const int64_t chunk = __atomic_load_n(&zk_chunk, __ATOMIC_RELAXED);
	for (int64_t i = lo; i < hi; i += chunk) {
		int64_t m = zk_min(chunk, hi - i);
		ZK_FN(zk_reduce_chunk)(t, bufs, n, dtype, op, i, m, zk_min(chunk, hi - i - m));
		/* cast once into rank 0's chunk, then copy those bits to the others */
		void* first = ZK_AT(bufs[0], dtype, i);
		ZK_FN(zk_store)(first, dtype, t, op, n, m);
		for (int r = 1; r < n; r++) {
			void* d = ZK_AT(bufs[r], dtype, i);
			if (d != first) memcpy(d, first, (size_t)(m * zk_size(dtype)));
		}
	}
}


/* ---- optimizers: one fused pass per range -------------------------------------- */

#ifndef ZK_OPT_BLOCK
#define ZK_OPT_BLOCK 1024 /* elements per block: 4 KiB of each buffer */
#endif

/* In-place square roots of x[0, n), in vector registers: IEEE square roots
 * round correctly, so these are sqrtf's bits. */
ZK_TARGET static void ZK_FN(zk_sqrt_block)(float* restrict x, int64_t n) {
	int64_t i = 0;
#if ZK_F16C >= 2
	for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_sqrt_ps(_mm512_loadu_ps(x + i)));
#endif
#if ZK_F16C >= 1
	for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#endif
#if ZK_MULTI
	for (; i + 4 <= n; i += 4) _mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#endif
	for (; i < n; i++) x[i] = sqrtf(x[i]);
}

/* AdamW over elements [a, b) of the shard with range r's settings; g is
 * scaled by gscale on the way in; the new parameter, cast to out_dt, goes
 * to out (may be NULL). */
ZK_TARGET static void ZK_FN(zk_adamw)(float* restrict p, float* restrict m, float* restrict v, float* restrict vmax,
                                      const float* restrict g, void* out, int out_dt, const zero_opt_range r0,
                                      float gscale, int64_t a, int64_t b) {
	const zero_opt_range r = r0;
	const int ams = (r.flags & ZERO_OPT_AMSGRAD) != 0;
	float root[ZK_OPT_BLOCK];
	/* In blocks that stay in L1: the moments, then the square roots, then
	 * the parameters and their cast. zero_adamw_elem's arithmetic, op for
	 * op, split so each pass vectorizes (sqrtf in a loop does not: it may
	 * set errno, and cgo refuses -fno-math-errno). */
	for (int64_t c = a; c < b; c += ZK_OPT_BLOCK) {
		const int64_t n = zk_min(ZK_OPT_BLOCK, b - c);
		float *pc = p + c, *mc = m + c, *vc = v + c;
		const float* gc = g + c;
		for (int64_t i = 0; i < n; i++) {
			const float gi = gc[i] * gscale;
			mc[i] = mc[i] + r.beta1c * (gi - mc[i]);
			vc[i] = vc[i] * r.beta2 + r.beta2c * (gi * gi);
			root[i] = vc[i];
		}
		if (ams) {
			float* xc = vmax + c;
			for (int64_t i = 0; i < n; i++) {
				const float d = (xc[i] > root[i]) ? xc[i] : root[i];
				xc[i] = d;
				root[i] = d;
			}
		}
		ZK_FN(zk_sqrt_block)(root, n);
		for (int64_t i = 0; i < n; i++) {
			const float denom = root[i] / r.bc2sqrt + r.eps;
			pc[i] = pc[i] * r.decay - r.step * (mc[i] / denom);
		}
		if (out) ZK_FN(zk_conv)(ZK_AT(out, out_dt, c), out_dt, pc, ZERO_F32, 1.0f, n);
	}
}

ZK_TARGET static void ZK_FN(zk_sgd)(float* restrict p, float* restrict buf, const float* restrict g, void* out,
                                    int out_dt, const zero_opt_range r0, float gscale, int64_t a, int64_t b) {
	const zero_opt_range r = r0;
	for (int64_t c = a; c < b; c += ZK_OPT_BLOCK) {
		const int64_t e = zk_min(c + ZK_OPT_BLOCK, b);
		if (buf) {
			for (int64_t i = c; i < e; i++) zero_sgd_elem(&p[i], &buf[i], g[i] * gscale, &r);
		} else {
			for (int64_t i = c; i < e; i++) zero_sgd_elem(&p[i], NULL, g[i] * gscale, &r);
		}
		if (out) ZK_FN(zk_conv)(ZK_AT(out, out_dt, c), out_dt, p + c, ZERO_F32, 1.0f, e - c);
	}
}

#endif /* ZK_TEMPLATE */
