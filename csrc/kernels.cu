/*
 * kernels.cu: the CUDA kernels of zero, device code only.
 *
 * `make cuda` compiles this file ahead of time, with nvrtc from PyPI, into
 * zero_kernels.fatbin (SASS for sm_80 and sm_90, PTX for newer GPUs), which
 * the library embeds and loads with the driver's module API; cuda_driver.c
 * holds the host side (descriptor staging, launch geometry). Nothing here
 * needs a CUDA header or the C library: the types come from ../cuda_abi.h.
 *
 * The scalar math (bf16/fp16 conversions with round-to-nearest-even,
 * scaling, copy-vs-add, the rank-order reduction) comes from
 * ../elementwise.h, which the host C kernels (kernels.c) include too.
 * Compiled with --fmad=false and IEEE division and denormals, every element
 * goes through the same operations in the same order as on the host, so both
 * paths give the same bits.
 *
 * Every kernel has a C name (extern "C"), listed in cuda_abi.h; the template
 * bodies live in kernels_dev.cuh, which csrc/emu_test.cc also runs on the
 * host where there is no GPU.
 */
#include "kernels_dev.cuh"

/* ---- batches of gradients: flatten (and cast), accumulate ------------------ */

template <int DT, int ST, bool SCALE>
__device__ __forceinline__ void zc_flatten(char* __restrict__ dst, const zc_segs_arg& a, float scale) {
	const zc_dseg* segs = a.ext ? (const zc_dseg*)a.ext : a.inl;
	zc_flatten_block<DT, ST, SCALE>(dst, segs, a.nseg, scale, blockIdx.x, threadIdx.x);
}

/* Block blockIdx.x's sum of squares of what it stored into acc, to
 * part[blockIdx.x]: read back after the block's barrier, from L2 where the
 * stores just went (the landing of a step's last reduction: the norm costs
 * no second read of the shard from memory). Not inlined, so that the
 * accumulate's registers stay as they were without it. */
template <int AT>
__device__ __noinline__ void zc_acc_squares(const char* acc, const zc_dseg* segs, int nseg, double* part) {
	__shared__ double s[ZC_THREADS];
	s[threadIdx.x] = zc_acc_sq_thread<AT>(acc, segs, nseg, blockIdx.x, threadIdx.x);
	const double r = zc_tree(s);
	if (threadIdx.x == 0) part[blockIdx.x] = r;
}

template <int AT, int ST, bool SCALE, bool FIRST>
__device__ __forceinline__ void zc_acc(char* __restrict__ acc, const zc_segs_arg& a, float scale, float* flag,
                                       double* part) {
	const zc_dseg* segs = a.ext ? (const zc_dseg*)a.ext : a.inl;
	uint32_t bad = zc_accumulate_block<AT, ST, SCALE, FIRST>(acc, segs, a.nseg, scale, blockIdx.x, threadIdx.x);
	/* a barrier as __syncthreads is: the block's stores are visible to all its threads after it */
	if (__syncthreads_or((int)bad) && threadIdx.x == 0 && flag) *flag = 1.0f;
	if (part) zc_acc_squares<AT>(acc, segs, a.nseg, part);
}

#define ZC_T0 ZERO_F32
#define ZC_T1 ZERO_BF16
#define ZC_T2 ZERO_F16
#define ZC_O0 ZERO_SUM
#define ZC_O1 ZERO_AVG
#define ZC_O2 ZERO_MAX

#define ZC_FLATTEN(d, s, c)                                                                                \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS)                                           \
	    zc_flatten_##d##s##c(char* __restrict__ dst, const __grid_constant__ zc_segs_arg a, float scale) { \
		zc_flatten<ZC_T##d, ZC_T##s, c>(dst, a, scale);                                            \
	}
#define ZC_FLATTEN_S(d, s) ZC_FLATTEN(d, s, 0) ZC_FLATTEN(d, s, 1)
#define ZC_FLATTEN_D(d) ZC_FLATTEN_S(d, 0) ZC_FLATTEN_S(d, 1) ZC_FLATTEN_S(d, 2)
ZC_FLATTEN_D(0)
ZC_FLATTEN_D(1)
ZC_FLATTEN_D(2)

#define ZC_ACC(d, s, c, f)                                                                                 \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS)                                           \
	    zc_acc_##d##s##c##f(char* __restrict__ acc, const __grid_constant__ zc_segs_arg a, float scale,  \
	                        float* flag, double* part) {                                               \
		zc_acc<ZC_T##d, ZC_T##s, c, f>(acc, a, scale, flag, part);                                 \
	}
#define ZC_ACC_S(d, s) ZC_ACC(d, s, 0, 0) ZC_ACC(d, s, 0, 1) ZC_ACC(d, s, 1, 0) ZC_ACC(d, s, 1, 1)
#define ZC_ACC_D(d) ZC_ACC_S(d, 0) ZC_ACC_S(d, 1) ZC_ACC_S(d, 2)
ZC_ACC_D(0)
ZC_ACC_D(1)
ZC_ACC_D(2)

/* ---- the parameters' way back: unflatten; the optimizers ------------------ */

#define ZC_UNFLATTEN(t)                                                                                    \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS)                                           \
	    zc_unflatten_##t(const char* __restrict__ flat, const __grid_constant__ zc_segs_arg a) {       \
		zc_unflatten_block<ZC_T##t>(flat, a.ext ? (const zc_dseg*)a.ext : a.inl, a.nseg, blockIdx.x,   \
		                            threadIdx.x);                                                  \
	}
ZC_UNFLATTEN(0)
ZC_UNFLATTEN(1)
ZC_UNFLATTEN(2)

#define ZC_OPT(d)                                                                                          \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS)                                           \
	    zc_adamw_##d(float* p, const float* g, float* m, float* v, float* vmax, char* out,             \
	                 const zc_odesc* ds, int nd, float gscale) {                                       \
		zc_opt_block<ZC_T##d, true>(p, g, m, v, vmax, out, ds, nd, gscale, blockIdx.x, threadIdx.x);   \
	}                                                                                                  \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS)                                           \
	    zc_sgd_##d(float* p, const float* g, float* buf, char* out, const zc_odesc* ds, int nd, float gscale) { \
		zc_opt_block<ZC_T##d, false>(p, g, buf, (float*)0, (float*)0, out, ds, nd, gscale, blockIdx.x,  \
		                             threadIdx.x);                                                 \
	}
ZC_OPT(0)
ZC_OPT(1)
ZC_OPT(2)

/* ---- the in-process reductions of the one-GPU group ---------------------- */

#define ZC_RED(t, o)                                                                                       \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS) zc_reduce_##t##o(const __grid_constant__ zc_red_arg a) { \
		zc_reduce_thread<ZC_T##t, ZC_O##o>(a, blockIdx.y, (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x,   \
		                                   (int64_t)gridDim.x * ZC_THREADS);                                 \
	}                                                                                                          \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS) zc_allreduce_##t##o(const __grid_constant__ zc_red_arg a) { \
		zc_allreduce_thread<ZC_T##t, ZC_O##o>(a, (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x,             \
		                                      (int64_t)gridDim.x * ZC_THREADS);                              \
	}
#define ZC_RED_T(t) ZC_RED(t, 0) ZC_RED(t, 1) ZC_RED(t, 2)
ZC_RED_T(0)
ZC_RED_T(1)
ZC_RED_T(2)

/* ---- sums of squares ------------------------------------------------------- */

/* The norm's chunks: block b sums the squares of chunk b of x, as the
 * accumulate kernels do for the chunk they stored (zc_chunk_sq_thread). */
#define ZC_CHUNKSQ(t)                                                                                      \
	extern "C" __global__ void __launch_bounds__(ZC_THREADS)                                           \
	    zc_chunksq_##t(const char* __restrict__ x, int64_t n, double* part) {                          \
		__shared__ double s[ZC_THREADS];                                                           \
		const int64_t start = (int64_t)blockIdx.x * ZC_CHUNK;                                      \
		s[threadIdx.x] = zc_chunk_sq_thread<ZC_T##t>(x, start, n < start + ZC_CHUNK ? n : start + ZC_CHUNK, \
		                                             threadIdx.x);                                 \
		const double r = zc_tree(s);                                                               \
		if (threadIdx.x == 0) part[blockIdx.x] = r;                                                \
	}
ZC_CHUNKSQ(0)
ZC_CHUNKSQ(1)
ZC_CHUNKSQ(2)

/* Block i adds the chunk sums of range i in zc_sumsq_final's order. */
extern "C" __global__ void __launch_bounds__(ZC_THREADS)
    zc_sumchunks(const double* __restrict__ part, const zc_crange* __restrict__ r, double* out) {
	__shared__ double s[ZC_THREADS];
	const zc_crange c = r[blockIdx.x];
	s[threadIdx.x] = zc_sum_thread(part + c.lo, c.hi - c.lo, threadIdx.x);
	const double sum = zc_tree(s);
	if (threadIdx.x == 0) out[blockIdx.x] = sum;
}

/* The whole fp32 shard's: per-block trees over a capped grid, then one tree
 * over the blocks. */
extern "C" __global__ void __launch_bounds__(ZC_THREADS)
    zc_sumsq_part(const float* __restrict__ x, int64_t n, double* part) {
	__shared__ double s[ZC_THREADS];
	s[threadIdx.x] = zc_sumsq_thread(x, n, (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x, (int64_t)gridDim.x * ZC_THREADS);
	const double r = zc_tree(s);
	if (threadIdx.x == 0) part[blockIdx.x] = r;
}

extern "C" __global__ void __launch_bounds__(ZC_THREADS) zc_sumsq_final(const double* part, int nb, double* out) {
	__shared__ double s[ZC_THREADS];
	s[threadIdx.x] = zc_sum_thread(part, nb, threadIdx.x);
	const double r = zc_tree(s);
	if (threadIdx.x == 0) *out = r;
}

/* ---- spin (tests): hold a stream back for about ns nanoseconds ------------- */

extern "C" __global__ void zc_spin(int64_t ns) {
	uint64_t t0, t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
	do {
		asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	} while ((int64_t)(t - t0) < ns);
}
