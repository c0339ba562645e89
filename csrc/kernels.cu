/*
 * kernels.cu: the CUDA C kernels of zero and their extern "C" launchers.
 *
 * The scalar math (bf16/fp16 conversions with round-to-nearest-even, scaling,
 * copy-vs-add, the rank-order reduction) comes from ../elementwise.h, the
 * header the host C kernels (kernels.c) include too. Built with --fmad=false
 * and IEEE division/denormals (no --use_fast_math), every element goes
 * through the same operations in the same order as on the host, so both
 * paths give the same bits.
 *
 * Layout of the work:
 *   - flatten / accumulate / cast: one launch per batch ("bucket"). The
 *     segments are cut into chunks of ZC_CHUNK elements; block b finds its
 *     segment by a binary search of the segments' first-block numbers and
 *     works on one chunk. A batch of up to ZC_INLINE_SEGS segments travels in
 *     the kernel parameters (__grid_constant__); a larger one is copied into
 *     a device-side descriptor array from a pinned staging ring.
 *   - Each thread moves packs of 8 elements with 16-byte loads and stores
 *     when the segment's source and destination are 16-byte aligned (always,
 *     for buffers from cudaMalloc and offsets that are multiples of 8), and
 *     falls back to one element at a time otherwise.
 *   - The in-process reductions (reduce-scatter and the fused all-reduce of
 *     the one-GPU group) are grid-stride loops over packs of 8.
 *
 * The kernel bodies live in kernels_dev.cuh, so that csrc/emu_test.cc can run
 * them on the host (`make cuda-emu`) where there is no GPU; this file wraps
 * them in __global__ kernels and holds the host side: descriptor staging,
 * kernel tables and the extern "C" launchers of zero_cuda.h.
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "kernels_dev.cuh"

/* ---- the kernels: the bodies of kernels_dev.cuh over the grid -------------- */

template <int DT, int ST, bool SCALE>
__global__ void __launch_bounds__(ZC_THREADS)
    zc_k_flatten(char* __restrict__ dst, const __grid_constant__ zc_segs_arg a, float scale) {
	zc_flatten_block<DT, ST, SCALE>(dst, a.ext ? a.ext : a.inl, a.nseg, scale, blockIdx.x, threadIdx.x);
}

template <int ST, bool SCALE, bool FIRST>
__global__ void __launch_bounds__(ZC_THREADS)
    zc_k_accumulate(float* __restrict__ acc, const __grid_constant__ zc_segs_arg a, float scale, float* flag) {
	uint32_t bad = zc_accumulate_block<ST, SCALE, FIRST>(acc, a.ext ? a.ext : a.inl, a.nseg, scale, blockIdx.x, threadIdx.x);
	if (__syncthreads_or((int)bad) && threadIdx.x == 0 && flag) *flag = 1.0f;
}

/* Output j = blockIdx.y. */
template <int T, int OP>
__global__ void __launch_bounds__(ZC_THREADS) zc_k_reduce(const __grid_constant__ zc_red_arg a) {
	zc_reduce_thread<T, OP>(a, blockIdx.y, (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x,
	                        (int64_t)gridDim.x * ZC_THREADS);
}

template <int T, int OP>
__global__ void __launch_bounds__(ZC_THREADS) zc_k_allreduce(const __grid_constant__ zc_red_arg a) {
	zc_allreduce_thread<T, OP>(a, (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x, (int64_t)gridDim.x * ZC_THREADS);
}

/* ---- sum of squares ------------------------------------------------------ */

/* A fixed tree over the block's threads; the result is in s[0]. */
__device__ __forceinline__ void zc_tree(double* s) {
	for (int w = ZC_THREADS / 2; w > 0; w >>= 1) {
		__syncthreads();
		if ((int)threadIdx.x < w) s[threadIdx.x] = s[threadIdx.x] + s[threadIdx.x + w];
	}
	__syncthreads();
}

__global__ void __launch_bounds__(ZC_THREADS) zc_k_sumsq_part(const float* __restrict__ x, int64_t n, double* part) {
	__shared__ double s[ZC_THREADS];
	s[threadIdx.x] = zc_sumsq_thread(x, n, (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x, (int64_t)gridDim.x * ZC_THREADS);
	zc_tree(s);
	if (threadIdx.x == 0) part[blockIdx.x] = s[0];
}

__global__ void __launch_bounds__(ZC_THREADS) zc_k_sumsq_final(const double* part, int nb, double* out) {
	__shared__ double s[ZC_THREADS];
	double acc = 0.0;
	for (int i = threadIdx.x; i < nb; i += ZC_THREADS) acc = acc + part[i];
	s[threadIdx.x] = acc;
	zc_tree(s);
	if (threadIdx.x == 0) *out = s[0];
}

/* ---- spin (tests) ---------------------------------------------------------- */

__device__ __forceinline__ uint64_t zc_globaltimer() {
	uint64_t t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}

__global__ void zc_k_spin(int64_t ns) {
	const uint64_t t0 = zc_globaltimer();
	while ((int64_t)(zc_globaltimer() - t0) < ns) {
	}
}

/* ====================================================================== */
/* host side                                                                */
/* ====================================================================== */

static int zc_set(int dev) { return (int)cudaSetDevice(dev); }


/* ---- the descriptor staging ring (one per device) ---------------------- */

#define ZC_RING_BYTES (1u << 20)
#define ZC_RING_SLOTS 256

struct zc_ring_ent {
	size_t lo, hi;
};

struct zc_ring {
	pthread_mutex_t mu;
	int ready;
	char* host; /* pinned */
	char* dev;
	size_t head;
	zc_ring_ent q[ZC_RING_SLOTS];
	cudaEvent_t ev[ZC_RING_SLOTS];
	int qh, qn;
};

static zc_ring zc_rings[ZC_MAX_DEVICES];
static pthread_once_t zc_rings_once = PTHREAD_ONCE_INIT;

static void zc_rings_init(void) {
	for (int i = 0; i < ZC_MAX_DEVICES; i++) pthread_mutex_init(&zc_rings[i].mu, NULL);
}

static int zc_ring_setup(zc_ring* r) {
	if (r->ready) return 0;
	int err = (int)cudaHostAlloc((void**)&r->host, ZC_RING_BYTES, cudaHostAllocPortable);
	if (err) return err;
	err = (int)cudaMalloc((void**)&r->dev, ZC_RING_BYTES);
	if (err) {
		cudaFreeHost(r->host);
		r->host = NULL;
		return err;
	}
	for (int i = 0; i < ZC_RING_SLOTS; i++) {
		err = (int)cudaEventCreateWithFlags(&r->ev[i], cudaEventDisableTiming);
		if (err) { /* undo, so a later call starts clean */
			while (i-- > 0) cudaEventDestroy(r->ev[i]);
			cudaFree(r->dev);
			cudaFreeHost(r->host);
			r->dev = NULL;
			r->host = NULL;
			return err;
		}
	}
	r->head = 0;
	r->qh = r->qn = 0;
	r->ready = 1;
	return 0;
}

static void zc_ring_pop(zc_ring* r) {
	r->qh = (r->qh + 1) % ZC_RING_SLOTS;
	r->qn--;
}

static int zc_overlaps(const zc_ring* r, size_t lo, size_t hi) {
	for (int k = 0; k < r->qn; k++) {
		const zc_ring_ent* e = &r->q[(r->qh + k) % ZC_RING_SLOTS];
		if (lo < e->hi && e->lo < hi) return 1;
	}
	return 0;
}

/* Reserve bytes in the ring (mutex held); waits for old launches if needed. */
static int zc_ring_reserve(zc_ring* r, size_t bytes, size_t* pos) {
	bytes = (bytes + 255) & ~(size_t)255;
	while (r->qn > 0 && cudaEventQuery(r->ev[r->qh]) == cudaSuccess) zc_ring_pop(r);
	size_t p = r->head;
	if (p + bytes > ZC_RING_BYTES) p = 0;
	while (r->qn > 0 && (r->qn == ZC_RING_SLOTS || zc_overlaps(r, p, p + bytes))) {
		int err = (int)cudaEventSynchronize(r->ev[r->qh]);
		if (err) return err;
		zc_ring_pop(r);
	}
	*pos = p;
	r->head = p + bytes;
	return 0;
}

/* Mark [pos, pos+bytes) busy until the work enqueued on s so far is done. */
static int zc_ring_commit(zc_ring* r, cudaStream_t s, size_t pos, size_t bytes) {
	int slot = (r->qh + r->qn) % ZC_RING_SLOTS;
	int err = (int)cudaEventRecord(r->ev[slot], s);
	if (err) return err;
	r->q[slot].lo = pos;
	r->q[slot].hi = pos + ((bytes + 255) & ~(size_t)255);
	r->qn++;
	return 0;
}

/* ---- segment batches ------------------------------------------------------ */

typedef int (*zc_seg_launch)(dim3 grid, cudaStream_t s, const zc_segs_arg& a, void* ctx);

/* Builds the descriptors of segs (dropping empty ones), places them inline
 * or in the ring, and calls launch once per batch; batches bigger than half
 * the ring are split (one launch per half-ring of descriptors). */
static int zc_run_segs(int dev, cudaStream_t s, const zc_seg* segs, int nseg, zc_seg_launch launch, void* ctx) {
	const int max_ring = (int)(ZC_RING_BYTES / 2 / sizeof(zc_dseg));
	zc_segs_arg a;
	int i = 0;
	while (i < nseg) {
		/* count the non-empty segments of this batch */
		int j = i, n = 0;
		while (j < nseg && n < max_ring) {
			if (segs[j].count > 0) n++;
			j++;
		}
		if (n == 0) return 0;
		if (n <= ZC_INLINE_SEGS) {
			int64_t blocks = 0;
			int k = zc_build_descs(segs, i, j, a.inl, &blocks);
			if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
			a.ext = NULL;
			a.nseg = k;
			int err = launch(dim3((unsigned)blocks), s, a, ctx);
			if (err) return err;
		} else {
			pthread_once(&zc_rings_once, zc_rings_init);
			zc_ring* r = &zc_rings[dev];
			pthread_mutex_lock(&r->mu);
			int err = zc_ring_setup(r);
			size_t pos = 0, bytes = (size_t)n * sizeof(zc_dseg);
			if (!err) err = zc_ring_reserve(r, bytes, &pos);
			if (!err) {
				zc_dseg* h = (zc_dseg*)(r->host + pos);
				int64_t blocks = 0;
				int k = zc_build_descs(segs, i, j, h, &blocks);
				if (blocks > 0x7fffffffLL) err = (int)cudaErrorInvalidConfiguration;
				if (!err) err = (int)cudaMemcpyAsync(r->dev + pos, h, bytes, cudaMemcpyHostToDevice, s);
				if (!err) {
					a.ext = (const zc_dseg*)(r->dev + pos);
					a.nseg = k;
					err = launch(dim3((unsigned)blocks), s, a, ctx);
				}
				/* the slot is reused only after this stream passed the launch,
				 * or after the copy, if the launch failed */
				int cerr = zc_ring_commit(r, s, pos, bytes);
				if (!err) err = cerr;
			}
			pthread_mutex_unlock(&r->mu);
			if (err) return err;
		}
		i = j;
	}
	return 0;
}

/* ---- kernel tables --------------------------------------------------------- */

struct zc_flatten_ctx {
	char* dst;
	float scale;
	int dt, st;
};

template <int DT, int ST, bool SC>
static void zc_launch_flatten(dim3 g, cudaStream_t s, const zc_segs_arg& a, char* dst, float scale) {
	zc_k_flatten<DT, ST, SC><<<g, ZC_THREADS, 0, s>>>(dst, a, scale);
}

typedef void (*zc_flatten_fn)(dim3, cudaStream_t, const zc_segs_arg&, char*, float);

#define ZC_FL(D, S) {zc_launch_flatten<D, S, false>, zc_launch_flatten<D, S, true>}
static const zc_flatten_fn zc_flatten_tbl[3][3][2] = {
    {ZC_FL(ZERO_F32, ZERO_F32), ZC_FL(ZERO_F32, ZERO_BF16), ZC_FL(ZERO_F32, ZERO_F16)},
    {ZC_FL(ZERO_BF16, ZERO_F32), ZC_FL(ZERO_BF16, ZERO_BF16), ZC_FL(ZERO_BF16, ZERO_F16)},
    {ZC_FL(ZERO_F16, ZERO_F32), ZC_FL(ZERO_F16, ZERO_BF16), ZC_FL(ZERO_F16, ZERO_F16)},
};
#undef ZC_FL

static int zc_flatten_launch(dim3 g, cudaStream_t s, const zc_segs_arg& a, void* ctx) {
	const zc_flatten_ctx* c = (const zc_flatten_ctx*)ctx;
	zc_flatten_tbl[zc_dt_index(c->dt)][zc_dt_index(c->st)][c->scale != 1.0f](g, s, a, c->dst, c->scale);
	return (int)cudaGetLastError();
}

struct zc_acc_ctx {
	float* acc;
	float* flag;
	float scale;
	int st, first;
};

template <int ST, bool SC, bool FIRST>
static void zc_launch_acc(dim3 g, cudaStream_t s, const zc_segs_arg& a, float* acc, float scale, float* flag) {
	zc_k_accumulate<ST, SC, FIRST><<<g, ZC_THREADS, 0, s>>>(acc, a, scale, flag);
}

typedef void (*zc_acc_fn)(dim3, cudaStream_t, const zc_segs_arg&, float*, float, float*);

#define ZC_AC(S) \
	{{zc_launch_acc<S, false, false>, zc_launch_acc<S, false, true>}, {zc_launch_acc<S, true, false>, zc_launch_acc<S, true, true>}}
static const zc_acc_fn zc_acc_tbl[3][2][2] = {ZC_AC(ZERO_F32), ZC_AC(ZERO_BF16), ZC_AC(ZERO_F16)};
#undef ZC_AC

static int zc_acc_launch(dim3 g, cudaStream_t s, const zc_segs_arg& a, void* ctx) {
	const zc_acc_ctx* c = (const zc_acc_ctx*)ctx;
	zc_acc_tbl[zc_dt_index(c->st)][c->scale != 1.0f][c->first != 0](g, s, a, c->acc, c->scale, c->flag);
	return (int)cudaGetLastError();
}

template <int T, int OP>
static void zc_launch_reduce(dim3 g, cudaStream_t s, const zc_red_arg& a) {
	zc_k_reduce<T, OP><<<g, ZC_THREADS, 0, s>>>(a);
}

template <int T, int OP>
static void zc_launch_allreduce(dim3 g, cudaStream_t s, const zc_red_arg& a) {
	zc_k_allreduce<T, OP><<<g, ZC_THREADS, 0, s>>>(a);
}

typedef void (*zc_red_fn)(dim3, cudaStream_t, const zc_red_arg&);

#define ZC_RD(F, T) {F<T, ZERO_SUM>, F<T, ZERO_AVG>, F<T, ZERO_MAX>}
static const zc_red_fn zc_reduce_tbl[3][3] = {ZC_RD(zc_launch_reduce, ZERO_F32), ZC_RD(zc_launch_reduce, ZERO_BF16),
                                              ZC_RD(zc_launch_reduce, ZERO_F16)};
static const zc_red_fn zc_allreduce_tbl[3][3] = {ZC_RD(zc_launch_allreduce, ZERO_F32),
                                                 ZC_RD(zc_launch_allreduce, ZERO_BF16),
                                                 ZC_RD(zc_launch_allreduce, ZERO_F16)};
#undef ZC_RD

/* ---- extern "C" launchers ----------------------------------------------------- */

extern "C" int zc_flatten(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, const zc_seg* segs, int nseg,
                          int src_dtype, float scale) {
	if (!zc_dtype_ok(dst_dtype) || !zc_dtype_ok(src_dtype)) return ZC_ERR_BAD_DTYPE;
	if (dev < 0 || dev >= ZC_MAX_DEVICES) return (int)cudaErrorInvalidDevice;
	int err = zc_set(dev);
	if (err) return err;
	zc_flatten_ctx c = {(char*)dst, scale, dst_dtype, src_dtype};
	return zc_run_segs(dev, (cudaStream_t)s, segs, nseg, zc_flatten_launch, &c);
}

extern "C" int zc_accumulate(int dev, uintptr_t s, uintptr_t acc, const zc_seg* segs, int nseg, int src_dtype,
                             int first, float scale, uintptr_t flag) {
	if (!zc_dtype_ok(src_dtype)) return ZC_ERR_BAD_DTYPE;
	if (dev < 0 || dev >= ZC_MAX_DEVICES) return (int)cudaErrorInvalidDevice;
	int err = zc_set(dev);
	if (err) return err;
	zc_acc_ctx c = {(float*)acc, (float*)flag, scale, src_dtype, first};
	return zc_run_segs(dev, (cudaStream_t)s, segs, nseg, zc_acc_launch, &c);
}

extern "C" int zc_cast(int dev, uintptr_t s, uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, int64_t n,
                       float scale) {
	zc_seg one = {src, n, 0};
	return zc_flatten(dev, s, dst, dst_dtype, &one, 1, src_dtype, scale);
}

extern "C" int zc_sumsq(int dev, uintptr_t s, uintptr_t x, int64_t n, double* out) {
	int err = zc_set(dev);
	if (err) return err;
	cudaStream_t st = (cudaStream_t)s;
	int64_t nb = (n + ZC_THREADS * 16 - 1) / (ZC_THREADS * 16);
	if (nb < 1) nb = 1;
	if (nb > ZC_SUMSQ_MAX_BLOCKS) nb = ZC_SUMSQ_MAX_BLOCKS;
	double* part = NULL; /* nb partial sums, then the result */
	err = (int)cudaMallocAsync((void**)&part, (size_t)(nb + 1) * sizeof(double), st);
	if (err) return err;
	zc_k_sumsq_part<<<(unsigned)nb, ZC_THREADS, 0, st>>>((const float*)x, n, part);
	err = (int)cudaGetLastError();
	if (!err) {
		zc_k_sumsq_final<<<1, ZC_THREADS, 0, st>>>(part, (int)nb, part + nb);
		err = (int)cudaGetLastError();
	}
	if (!err) err = (int)cudaMemcpyAsync(out, part + nb, sizeof(double), cudaMemcpyDefault, st);
	int ferr = (int)cudaFreeAsync(part, st);
	return err ? err : ferr;
}

extern "C" int zc_reduce(int dev, uintptr_t s, const uintptr_t* dsts, int nout, const uintptr_t* srcs, int nsrc,
                         int dtype, int op, int64_t count) {
	if (nout <= 0 || nsrc <= 0 || count <= 0) return 0;
	zc_red_arg a;
	int err = zc_red_setup(&a, dsts, nout, srcs, nsrc, dtype, op, count);
	if (err) return err;
	if ((err = zc_set(dev))) return err;
	int64_t items = a.vec ? count / ZC_PACK : count;
	dim3 g(zc_grid(items), (unsigned)nout);
	zc_reduce_tbl[zc_dt_index(dtype)][zc_op_index(op)](g, (cudaStream_t)s, a);
	return (int)cudaGetLastError();
}

extern "C" int zc_allreduce(int dev, uintptr_t s, const uintptr_t* bufs, int n, int dtype, int op, int64_t count) {
	if (n <= 0 || count <= 0) return 0;
	zc_red_arg a;
	int err = zc_red_setup(&a, bufs, 0, bufs, n, dtype, op, count);
	if (err) return err;
	if ((err = zc_set(dev))) return err;
	int64_t items = a.vec ? count / ZC_PACK : count;
	zc_allreduce_tbl[zc_dt_index(dtype)][zc_op_index(op)](dim3(zc_grid(items)), (cudaStream_t)s, a);
	return (int)cudaGetLastError();
}

extern "C" int zc_spin(int dev, uintptr_t s, int64_t ns) {
	int err = zc_set(dev);
	if (err) return err;
	zc_k_spin<<<1, 1, 0, (cudaStream_t)s>>>(ns);
	return (int)cudaGetLastError();
}
