/*
 * kernels.c: the host C kernels (see kernels.h). Compiled by cgo with the
 * flags in kernels.go (-O3, -ffp-contract=off).
 *
 * Every hot loop is specialised for its dtypes, its op and whether it scales:
 * a switch outside the loop calls an always-inline loop body with constant
 * arguments, so the compiler folds the dtype switches of zero_load/zero_store
 * away and vectorises what is left. No loop switches on a dtype per element.
 */
#include <string.h>

#include "kernels.h"

#define ZK_INLINE static inline __attribute__((always_inline))

/* Work space of the reductions: 4096 fp32 = 16 KiB, so the chunk of a few
 * ranks plus the work space stay in L1/L2. */
#define ZK_CHUNK 4096

static int zk_size(int dtype) { return dtype == ZERO_F32 ? 4 : 2; }

#define ZK_AT(p, dtype, i) ((void*)((char*)(p) + (i) * (int64_t)zk_size(dtype)))
#define ZK_CAT(p, dtype, i) ((const void*)((const char*)(p) + (i) * (int64_t)zk_size(dtype)))

/* ---- convert (flatten, cast) ----------------------------------------------- */

ZK_INLINE void zk_conv_loop(void* restrict dst, int dt, const void* restrict src, int st, float scale, int doscale,
                            int64_t n) {
	for (int64_t i = 0; i < n; i++) {
		float v = zero_load(src, st, i);
		if (doscale) v = v * scale;
		zero_store(dst, dt, i, v);
	}
}

#define ZK_CONV_CASE(D, S)                                                                                       \
	case (D) * 3 + (S):                                                                                      \
		if (doscale)                                                                                     \
			zk_conv_loop(dst, D, src, S, scale, 1, n);                                               \
		else                                                                                             \
			zk_conv_loop(dst, D, src, S, 1.0f, 0, n);                                                \
		break;

/* dst[i] = cast(load(src, i) * scale), i in [0, n); dst and src already offset. */
static void zk_conv(void* restrict dst, int dt, const void* restrict src, int st, float scale, int64_t n) {
	int doscale = scale != 1.0f;
	switch (dt * 3 + st) {
		ZK_CONV_CASE(ZERO_F32, ZERO_F32)
		ZK_CONV_CASE(ZERO_F32, ZERO_BF16)
		ZK_CONV_CASE(ZERO_F32, ZERO_F16)
		ZK_CONV_CASE(ZERO_BF16, ZERO_F32)
		ZK_CONV_CASE(ZERO_BF16, ZERO_BF16)
		ZK_CONV_CASE(ZERO_BF16, ZERO_F16)
		ZK_CONV_CASE(ZERO_F16, ZERO_F32)
		ZK_CONV_CASE(ZERO_F16, ZERO_BF16)
		ZK_CONV_CASE(ZERO_F16, ZERO_F16)
	default:
		break;
	}
}

void zero_flatten(void* dst, int dst_dtype, const zero_seg* segs, int nseg, int src_dtype, float scale,
                  int64_t lo, int64_t hi) {
	for (int s = 0; s < nseg; s++) {
		int64_t off = segs[s].offset;
		int64_t a = off > lo ? off : lo;
		int64_t b = off + segs[s].count < hi ? off + segs[s].count : hi;
		if (a >= b) continue;
		zk_conv(ZK_AT(dst, dst_dtype, a), dst_dtype, ZK_CAT(segs[s].ptr, src_dtype, a - off), src_dtype, scale,
		        b - a);
	}
}

void zero_cast(void* dst, int dst_dtype, const void* src, int src_dtype, float scale, int64_t lo, int64_t hi) {
	if (lo >= hi) return;
	zk_conv(ZK_AT(dst, dst_dtype, lo), dst_dtype, ZK_CAT(src, src_dtype, lo), src_dtype, scale, hi - lo);
}

/* ---- accumulate ----------------------------------------------------------- */

/* Returns nonzero if a result is inf or NaN. The flag is an OR-reduction over
 * the exponent test, which vectorises. */
ZK_INLINE uint32_t zk_acc_loop(float* restrict acc, const void* restrict src, int st, float scale, int doscale,
                               int first, int64_t n) {
	uint32_t bad = 0;
	for (int64_t i = 0; i < n; i++) {
		float v = zero_load(src, st, i);
		if (doscale) v = v * scale;
		float r = first ? v : acc[i] + v;
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

static uint32_t zk_acc(float* restrict acc, const void* restrict src, int st, int first, float scale, int64_t n) {
	int doscale = scale != 1.0f;
	switch (st) {
		ZK_ACC_CASE(ZERO_F32)
		ZK_ACC_CASE(ZERO_BF16)
		ZK_ACC_CASE(ZERO_F16)
	default:
		return 0;
	}
}

void zero_accumulate(float* acc, const zero_seg* segs, int nseg, int src_dtype, int first, float scale,
                     float* flag, int64_t lo, int64_t hi) {
	uint32_t bad = 0;
	for (int s = 0; s < nseg; s++) {
		int64_t off = segs[s].offset;
		int64_t a = off > lo ? off : lo;
		int64_t b = off + segs[s].count < hi ? off + segs[s].count : hi;
		if (a >= b) continue;
		bad |= zk_acc(acc + a, ZK_CAT(segs[s].ptr, src_dtype, a - off), src_dtype, first != 0, scale, b - a);
	}
	if (bad && flag) *flag = 1.0f;
}

/* ---- sum of squares -------------------------------------------------------- */

#define ZK_LANES 16

double zero_sumsq(const float* x, int64_t lo, int64_t hi) {
	double s[ZK_LANES];
	for (int k = 0; k < ZK_LANES; k++) s[k] = 0.0;
	if (lo >= hi) return 0.0;
	const float* restrict p = x + lo;
	int64_t n = hi - lo, i = 0;
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
	for (int w = ZK_LANES / 2; w > 0; w /= 2)
		for (int k = 0; k < w; k++) s[k] = s[k] + s[k + w];
	return s[0];
}

/* ---- reductions across ranks ----------------------------------------------- */

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

static void zk_load(float* restrict t, const void* restrict src, int dt, int64_t n) {
	switch (dt) {
	case ZERO_F32: zk_load_loop(t, src, ZERO_F32, n); break;
	case ZERO_BF16: zk_load_loop(t, src, ZERO_BF16, n); break;
	case ZERO_F16: zk_load_loop(t, src, ZERO_F16, n); break;
	default: break;
	}
}

#define ZK_COMBINE_CASE(D)                                                                                       \
	case D:                                                                                                  \
		if (op == ZERO_MAX)                                                                              \
			zk_combine_loop(t, src, D, ZERO_MAX, n);                                                 \
		else                                                                                             \
			zk_combine_loop(t, src, D, ZERO_SUM, n);                                                 \
		break;

static void zk_combine(float* restrict t, const void* restrict src, int dt, int op, int64_t n) {
	switch (dt) {
		ZK_COMBINE_CASE(ZERO_F32)
		ZK_COMBINE_CASE(ZERO_BF16)
		ZK_COMBINE_CASE(ZERO_F16)
	default:
		break;
	}
}

#define ZK_STORE_CASE(D)                                                                                         \
	case D:                                                                                                  \
		if (op == ZERO_AVG)                                                                              \
			zk_store_loop(dst, D, t, ZERO_AVG, nr, n);                                               \
		else                                                                                             \
			zk_store_loop(dst, D, t, ZERO_SUM, nr, n);                                               \
		break;

static void zk_store(void* restrict dst, int dt, const float* restrict t, int op, int nr, int64_t n) {
	switch (dt) {
		ZK_STORE_CASE(ZERO_F32)
		ZK_STORE_CASE(ZERO_BF16)
		ZK_STORE_CASE(ZERO_F16)
	default:
		break;
	}
}

/* t[0..m) = op over the n buffers' elements [i, i+m), in rank order, in fp32 */
static void zk_reduce_chunk(float* restrict t, const uintptr_t* bufs, int n, int dt, int op, int64_t i, int64_t m) {
	zk_load(t, ZK_CAT(bufs[0], dt, i), dt, m);
	for (int r = 1; r < n; r++) zk_combine(t, ZK_CAT(bufs[r], dt, i), dt, op, m);
}

void zero_reduce(void* dst, const uintptr_t* srcs, int n, int dtype, int op, int64_t lo, int64_t hi) {
	float t[ZK_CHUNK] __attribute__((aligned(64)));
	if (n <= 0) return;
	for (int64_t i = lo; i < hi; i += ZK_CHUNK) {
		int64_t m = hi - i < ZK_CHUNK ? hi - i : ZK_CHUNK;
		zk_reduce_chunk(t, srcs, n, dtype, op, i, m);
		zk_store(ZK_AT(dst, dtype, i), dtype, t, op, n, m);
	}
}

void zero_allreduce_fused(const uintptr_t* bufs, int n, int dtype, int op, int64_t lo, int64_t hi) {
	float t[ZK_CHUNK] __attribute__((aligned(64)));
	if (n <= 0) return;
	for (int64_t i = lo; i < hi; i += ZK_CHUNK) {
		int64_t m = hi - i < ZK_CHUNK ? hi - i : ZK_CHUNK;
		zk_reduce_chunk(t, bufs, n, dtype, op, i, m);
		/* cast once into rank 0's chunk, then copy those bits to the others */
		void* first = ZK_AT(bufs[0], dtype, i);
		zk_store(first, dtype, t, op, n, m);
		for (int r = 1; r < n; r++) {
			void* d = ZK_AT(bufs[r], dtype, i);
			if (d != first) memcpy(d, first, (size_t)(m * zk_size(dtype)));
		}
	}
}

/* ---- benchmark yardsticks -------------------------------------------------- */

void zero_yard_copy16(uint16_t* restrict dst, const uint16_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = src[i];
}

void zero_yard_copy32(uint32_t* restrict dst, const uint32_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = src[i];
}

void zero_yard_widen(uint32_t* restrict dst, const uint16_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = src[i];
}

void zero_yard_narrow(uint16_t* restrict dst, const uint32_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = (uint16_t)(src[i] >> 16);
}

void zero_yard_add32(float* restrict acc, const float* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) acc[i] += src[i];
}

void zero_yard_add16(float* restrict acc, const uint16_t* restrict src, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) acc[i] += (float)src[i];
}

uint32_t zero_yard_read32(const uint32_t* restrict x, int64_t lo, int64_t hi) {
	uint32_t s = 0;
	for (int64_t i = lo; i < hi; i++) s ^= x[i];
	return s;
}

void zero_yard_sum4_32(float* restrict dst, const float* restrict a, const float* restrict b, const float* restrict c,
                       const float* restrict d, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = a[i] + b[i] + c[i] + d[i];
}

void zero_yard_sum4_16(uint16_t* restrict dst, const uint16_t* restrict a, const uint16_t* restrict b,
                       const uint16_t* restrict c, const uint16_t* restrict d, int64_t lo, int64_t hi) {
	for (int64_t i = lo; i < hi; i++) dst[i] = (uint16_t)(a[i] + b[i] + c[i] + d[i]);
}

void zero_yard_allsum4_32(float* restrict a, float* restrict b, float* restrict c, float* restrict d, int64_t lo,
                          int64_t hi) {
	for (int64_t i = lo; i < hi; i++) {
		float s = a[i] + b[i] + c[i] + d[i];
		a[i] = s;
		b[i] = s;
		c[i] = s;
		d[i] = s;
	}
}
