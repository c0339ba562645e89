/*
 * emu_launch.h: the CUDA kernel bodies of kernels_dev.cuh run over a whole
 * launch on the host, block by block and thread by thread. Used by
 * emu_test.cc (`make cuda-emu`) and by the fake libcuda.so.1 of the tests
 * (testdata/fakecuda), which runs the library's launches this way.
 */
#ifndef ZERO_EMU_LAUNCH_H
#define ZERO_EMU_LAUNCH_H

#include "kernels_dev.cuh"

/* ---- dispatch of the templated bodies over a whole launch ------------------- */

template <int DT, int ST, bool SC>
static void run_flatten(char* dst, const zc_dseg* d, int n, float scale, int64_t blocks) {
	for (int64_t b = 0; b < blocks; b++)
		for (int t = 0; t < ZC_THREADS; t++) zc_flatten_block<DT, ST, SC>(dst, d, n, scale, b, t);
}

template <int DT, int ST>
static void run_flatten2(char* dst, const zc_dseg* d, int n, float scale, int64_t blocks) {
	if (scale != 1.0f)
		run_flatten<DT, ST, true>(dst, d, n, scale, blocks);
	else
		run_flatten<DT, ST, false>(dst, d, n, scale, blocks);
}

template <int DT>
static void run_flatten1(char* dst, int st, const zc_dseg* d, int n, float scale, int64_t blocks) {
	switch (st) {
	case ZERO_F32: run_flatten2<DT, ZERO_F32>(dst, d, n, scale, blocks); break;
	case ZERO_BF16: run_flatten2<DT, ZERO_BF16>(dst, d, n, scale, blocks); break;
	default: run_flatten2<DT, ZERO_F16>(dst, d, n, scale, blocks); break;
	}
}

static void emu_flatten(char* dst, int dt, int st, const zc_dseg* d, int n, float scale, int64_t blocks) {
	switch (dt) {
	case ZERO_F32: run_flatten1<ZERO_F32>(dst, st, d, n, scale, blocks); break;
	case ZERO_BF16: run_flatten1<ZERO_BF16>(dst, st, d, n, scale, blocks); break;
	default: run_flatten1<ZERO_F16>(dst, st, d, n, scale, blocks); break;
	}
}

/* A block's threads run one after another, so a block's barrier is the end
 * of the loop over its threads: with part, the squares of what block b
 * stored are read back after all of them, then the tree. */
template <int AT, int ST, bool SC, bool FIRST>
static bool run_acc(char* acc, const zc_dseg* d, int n, float scale, int64_t blocks, double* part) {
	uint32_t bad = 0;
	double s[ZC_THREADS];
	for (int64_t b = 0; b < blocks; b++) {
		uint32_t block_bad = 0; /* __syncthreads_or over the block */
		for (int t = 0; t < ZC_THREADS; t++) block_bad |= zc_accumulate_block<AT, ST, SC, FIRST>(acc, d, n, scale, b, t);
		bad |= block_bad;
		if (!part) continue;
		for (int t = 0; t < ZC_THREADS; t++) s[t] = zc_acc_sq_thread<AT>(acc, d, n, b, t);
		part[b] = zc_tree(s);
	}
	return bad != 0;
}

template <int AT, int ST>
static bool run_acc2(char* acc, const zc_dseg* d, int n, float scale, int first, int64_t blocks, double* part) {
	if (scale != 1.0f)
		return first ? run_acc<AT, ST, true, true>(acc, d, n, scale, blocks, part)
		             : run_acc<AT, ST, true, false>(acc, d, n, scale, blocks, part);
	return first ? run_acc<AT, ST, false, true>(acc, d, n, scale, blocks, part)
	             : run_acc<AT, ST, false, false>(acc, d, n, scale, blocks, part);
}

template <int AT>
static bool run_acc1(char* acc, int st, const zc_dseg* d, int n, float scale, int first, int64_t blocks, double* part) {
	switch (st) {
	case ZERO_F32: return run_acc2<AT, ZERO_F32>(acc, d, n, scale, first, blocks, part);
	case ZERO_BF16: return run_acc2<AT, ZERO_BF16>(acc, d, n, scale, first, blocks, part);
	default: return run_acc2<AT, ZERO_F16>(acc, d, n, scale, first, blocks, part);
	}
}

/* An accumulate launch into acc of dtype at; true if a block raised the
 * flag. With part, block b's sum of squares of what it stored goes to
 * part[b]. */
static bool emu_accumulate(char* acc, int at, int st, const zc_dseg* d, int n, float scale, int first, int64_t blocks,
                           double* part = nullptr) {
	switch (at) {
	case ZERO_F32: return run_acc1<ZERO_F32>(acc, st, d, n, scale, first, blocks, part);
	case ZERO_BF16: return run_acc1<ZERO_BF16>(acc, st, d, n, scale, first, blocks, part);
	default: return run_acc1<ZERO_F16>(acc, st, d, n, scale, first, blocks, part);
	}
}

template <int T>
static void run_chunksq(const char* x, int64_t n, double* part) {
	double s[ZC_THREADS];
	for (int64_t b = 0; b * ZC_CHUNK < n; b++) {
		const int64_t start = b * ZC_CHUNK, end = n < start + ZC_CHUNK ? n : start + ZC_CHUNK;
		for (int t = 0; t < ZC_THREADS; t++) s[t] = zc_chunk_sq_thread<T>(x, start, end, t);
		part[b] = zc_tree(s);
	}
}

/* A zc_chunksq launch over x[0, n) of dtype dt: part[b] for chunk b. */
static void emu_chunk_squares(const char* x, int dt, int64_t n, double* part) {
	switch (dt) {
	case ZERO_F32: run_chunksq<ZERO_F32>(x, n, part); break;
	case ZERO_BF16: run_chunksq<ZERO_BF16>(x, n, part); break;
	default: run_chunksq<ZERO_F16>(x, n, part); break;
	}
}

/* A zc_sumchunks launch of nr blocks: out[i] = the sum of part[r[i].lo,
 * r[i].hi). With r = {0, nb}, zc_sumsq_final's. */
static void emu_sum_chunks(const double* part, const zc_crange* r, int64_t nr, double* out) {
	double s[ZC_THREADS];
	for (int64_t i = 0; i < nr; i++) {
		for (int t = 0; t < ZC_THREADS; t++) s[t] = zc_sum_thread(part + r[i].lo, r[i].hi - r[i].lo, t);
		out[i] = zc_tree(s);
	}
}

template <int T, int OP>
static void run_red(const zc_red_arg& a, unsigned grid, bool all) {
	const int64_t stride = (int64_t)grid * ZC_THREADS;
	if (all) {
		for (int64_t g = 0; g < stride; g++) zc_allreduce_thread<T, OP>(a, g, stride);
		return;
	}
	for (int j = 0; j < a.nout; j++)
		for (int64_t g = 0; g < stride; g++) zc_reduce_thread<T, OP>(a, j, g, stride);
}

template <int T>
static void run_red1(const zc_red_arg& a, int op, unsigned grid, bool all) {
	switch (op) {
	case ZERO_SUM: run_red<T, ZERO_SUM>(a, grid, all); break;
	case ZERO_AVG: run_red<T, ZERO_AVG>(a, grid, all); break;
	default: run_red<T, ZERO_MAX>(a, grid, all); break;
	}
}

static void emu_reduce(const zc_red_arg& a, int dt, int op, unsigned grid, bool all) {
	switch (dt) {
	case ZERO_F32: run_red1<ZERO_F32>(a, op, grid, all); break;
	case ZERO_BF16: run_red1<ZERO_BF16>(a, op, grid, all); break;
	default: run_red1<ZERO_F16>(a, op, grid, all); break;
	}
}

template <int T>
static void run_unflatten(const char* flat, const zc_dseg* d, int n, int64_t blocks) {
	for (int64_t b = 0; b < blocks; b++)
		for (int t = 0; t < ZC_THREADS; t++) zc_unflatten_block<T>(flat, d, n, b, t);
}

static void emu_unflatten(const char* flat, int dt, const zc_dseg* d, int n, int64_t blocks) {
	switch (dt) {
	case ZERO_F32: run_unflatten<ZERO_F32>(flat, d, n, blocks); break;
	case ZERO_BF16: run_unflatten<ZERO_BF16>(flat, d, n, blocks); break;
	default: run_unflatten<ZERO_F16>(flat, d, n, blocks); break;
	}
}

template <int OUT, bool ADAM>
static void run_opt(float* p, const float* g, float* m, float* v, float* vmax, char* out, const zc_odesc* ds, int nd,
                    float gscale, int64_t blocks) {
	for (int64_t b = 0; b < blocks; b++)
		for (int t = 0; t < ZC_THREADS; t++) zc_opt_block<OUT, ADAM>(p, g, m, v, vmax, out, ds, nd, gscale, b, t);
}

/* An AdamW (adam) or SGD launch; out_dt is out's dtype (out may be NULL). */
static void emu_opt(bool adam, float* p, const float* g, float* m, float* v, float* vmax, char* out, int out_dt,
                    const zc_odesc* ds, int nd, float gscale, int64_t blocks) {
#define ZC_EMU_OPT(D)                                                                                      \
	(adam ? run_opt<D, true>(p, g, m, v, vmax, out, ds, nd, gscale, blocks)                             \
	      : run_opt<D, false>(p, g, m, v, vmax, out, ds, nd, gscale, blocks))
	switch (out_dt) {
	case ZERO_BF16: ZC_EMU_OPT(ZERO_BF16); break;
	case ZERO_F16: ZC_EMU_OPT(ZERO_F16); break;
	default: ZC_EMU_OPT(ZERO_F32); break;
	}
#undef ZC_EMU_OPT
}

#endif /* ZERO_EMU_LAUNCH_H */
