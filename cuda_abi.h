/*
 * cuda_abi.h: what the host side of the CUDA path (cuda_driver.c) and the
 * CUDA kernels (csrc/kernels.cu, compiled ahead of time into
 * zero_kernels.fatbin) must agree on: launch geometry, the descriptors of a
 * batch of gradients, the arguments of the in-process reductions, and the
 * kernels' names. Plain C, also read by nvrtc and by the host emulation of
 * the kernel bodies (csrc/emu_test.cc, the fake libcuda of the tests), so
 * its structs have one layout everywhere.
 */
#ifndef ZERO_CUDA_ABI_H
#define ZERO_CUDA_ABI_H

#include "elementwise.h"

#if defined(__CUDACC__)
#define ZC_ABI_FN static __host__ __device__ __forceinline__
#else
#define ZC_ABI_FN static inline
#endif

#define ZC_THREADS 256                              /* threads per block */
#define ZC_PACK 8                                   /* elements per 16-byte pack */
#define ZC_UNROLL 4                                 /* packs per thread per chunk */
#define ZC_CHUNK (ZC_THREADS * ZC_PACK * ZC_UNROLL) /* elements per block of a batch */
#define ZC_INLINE_SEGS 32                           /* segments that travel in the kernel parameters */
#define ZC_MAX_RANKS 32                             /* buffers of one in-process reduction */
#define ZC_MAX_DEVICES 64
#define ZC_SUMSQ_MAX_BLOCKS 1024 /* partial sums of the sum of squares */

/* Own status codes, past every CUresult and ncclResult_t value. */
#define ZC_ERR_TOO_MANY_RANKS 10001 /* more than ZC_MAX_RANKS buffers */
#define ZC_ERR_BAD_DTYPE 10002      /* a dtype or op code out of range */
#define ZC_ERR_NO_NCCL 10003        /* libnccl.so.2 not loaded */
#define ZC_ERR_NO_DRIVER 10004      /* libcuda.so.1 not loaded */
#define ZC_ERR_OLD_DRIVER 10005     /* a driver older than ZC_MIN_DRIVER */
#define ZC_ERR_NO_KERNELS 10006     /* no fatbin given, or a kernel missing from it */

/* The oldest driver the fatbin loads on: CUDA 12.0 (driver 525.60). */
#define ZC_MIN_DRIVER 12000

/* One gradient of a batch: source address, element count, and the offset
 * (elements) of its first element in the flat destination. The layout
 * matches zero_seg of kernels.h and segment of kernels.go. */
typedef struct {
	uintptr_t ptr;
	int64_t count;
	int64_t offset;
} zc_seg;

/* A segment as the kernels see it: block0 is the number of the first block
 * of the launch that works on it. */
typedef struct {
	uintptr_t src;
	int64_t count;
	int64_t offset;
	int64_t block0;
} zc_dseg;

/* A batch: up to ZC_INLINE_SEGS descriptors inline, or ext, the device
 * address of an array of nseg descriptors. */
typedef struct {
	uintptr_t ext;
	int nseg;
	zc_dseg inl[ZC_INLINE_SEGS];
} zc_segs_arg;

/* An in-process reduction: output j (nout of them) is the op over the nsrc
 * sources of their elements [j*count, (j+1)*count). vec when every address
 * and the per-output stride allow 16-byte packs. */
typedef struct {
	uintptr_t dst[ZC_MAX_RANKS];
	uintptr_t src[ZC_MAX_RANKS];
	int nout;
	int nsrc;
	int64_t count;
	int vec;
} zc_red_arg;

/* A range of an optimizer pass as the kernels see it: block0 is the number
 * of the first block of the launch that works on it. */
typedef struct {
	zero_opt_range r;
	int64_t block0;
} zc_odesc;

/* A run [lo, hi) of chunk sums (the norm's), summed into one output. The
 * layout matches chunkRange of device.go. */
typedef struct {
	int64_t lo, hi;
} zc_crange;

ZC_ABI_FN int zc_size(int t) { return t == ZERO_F32 ? 4 : 2; }

/* Row of a dtype or op in the kernel tables, in the order F32, BF16, F16 and
 * SUM, AVG, MAX whatever the codes' values; -1 for a code out of range. */
ZC_ABI_FN int zc_dt_index(int t) { return t == ZERO_F32 ? 0 : t == ZERO_BF16 ? 1 : t == ZERO_F16 ? 2 : -1; }
ZC_ABI_FN int zc_op_index(int op) { return op == ZERO_SUM ? 0 : op == ZERO_AVG ? 1 : op == ZERO_MAX ? 2 : -1; }
ZC_ABI_FN int zc_dtype_ok(int t) { return zc_dt_index(t) >= 0; }

#if !defined(__CUDACC_RTC__)
#include <string.h>

/* Fill out[] with the non-empty optimizer ranges of r[lo, hi), numbering
 * their blocks from 0; returns the number of descriptors and sets *blocks. */
static inline int zc_build_odescs(const zero_opt_range* r, int lo, int hi, zc_odesc* out, int64_t* blocks) {
	int64_t b = 0;
	int k = 0;
	for (int m = lo; m < hi; m++) {
		if (r[m].count <= 0) continue;
		out[k].r = r[m];
		out[k].block0 = b;
		b += (r[m].count + ZC_CHUNK - 1) / ZC_CHUNK;
		k++;
	}
	*blocks = b;
	return k;
}

/* Fill out[] with the non-empty segments of segs[lo, hi), numbering their
 * blocks from 0; returns the number of descriptors and sets *blocks. */
static inline int zc_build_descs(const zc_seg* segs, int lo, int hi, zc_dseg* out, int64_t* blocks) {
	int64_t b = 0;
	int k = 0;
	for (int m = lo; m < hi; m++) {
		if (segs[m].count <= 0) continue;
		out[k].src = segs[m].ptr;
		out[k].count = segs[m].count;
		out[k].offset = segs[m].offset;
		out[k].block0 = b;
		b += (segs[m].count + ZC_CHUNK - 1) / ZC_CHUNK;
		k++;
	}
	*blocks = b;
	return k;
}

/* Blocks for a grid-stride loop over `items` threads' worth of work. */
static inline unsigned zc_grid(int64_t items) {
	int64_t b = (items + ZC_THREADS - 1) / ZC_THREADS;
	if (b < 1) b = 1;
	if (b > 8192) b = 8192;
	return (unsigned)b;
}

/* The arguments of an in-process reduction. */
static inline int zc_red_setup(zc_red_arg* a, const uintptr_t* dsts, int nout, const uintptr_t* srcs, int nsrc,
                               int dtype, int op, int64_t count) {
	if (!zc_dtype_ok(dtype) || zc_op_index(op) < 0) return ZC_ERR_BAD_DTYPE;
	if (nout > ZC_MAX_RANKS || nsrc > ZC_MAX_RANKS) return ZC_ERR_TOO_MANY_RANKS;
	memset(a, 0, sizeof(*a));
	uintptr_t any = 0;
	for (int k = 0; k < nout; k++) any |= (a->dst[k] = dsts[k]);
	for (int k = 0; k < nsrc; k++) any |= (a->src[k] = srcs[k]);
	a->nout = nout;
	a->nsrc = nsrc;
	a->count = count;
	a->vec = (any & 15u) == 0 && (count * zc_size(dtype)) % 16 == 0;
	return 0;
}
#endif

/* ---- the kernels of the fatbin, by name ------------------------------------
 * d, s, t: dtype rows (zc_dt_index); o: op row (zc_op_index); c: 1 when a
 * scale other than 1 is applied; f: 1 for the first accumulate (copy).
 *   zc_flatten_<d><s><c>(char* dst, zc_segs_arg a, float scale)
 *   zc_acc_<d><s><c><f>(char* acc, zc_segs_arg a, float scale, float* flag, double* part)
 *                                         d: acc's dtype row; part: NULL, or block b's sum of
 *                                         squares of what it stored goes to part[b] (one
 *                                         segment: b is its chunk, ZC_CHUNK elements)
 *   zc_reduce_<t><o>(zc_red_arg a)        grid (x, nout)
 *   zc_allreduce_<t><o>(zc_red_arg a)
 *   zc_unflatten_<t>(const char* flat, zc_segs_arg a)   seg.src is the destination
 *   zc_adamw_<d>(float* p, const float* g, float* m, float* v, float* vmax, char* out,
 *                const zc_odesc* ranges, int n, float gscale)     d: out's dtype row
 *   zc_sgd_<d>(float* p, const float* g, float* buf, char* out, const zc_odesc* ranges, int n, float gscale)
 *   zc_chunksq_<t>(const char* x, int64_t n, double* part)   block b: part[b] = the sum of
 *                                         squares of chunk b of x, as zc_acc's part
 *   zc_sumchunks(const double* part, const zc_crange* r, double* out)   block i: out[i] =
 *                                         the sum of part[r[i].lo .. r[i].hi), as zc_sumsq_final
 *   zc_sumsq_part(const float* x, int64_t n, double* part)
 *   zc_sumsq_final(const double* part, int nb, double* out)
 *   zc_spin(int64_t ns)
 */

#endif /* ZERO_CUDA_ABI_H */
