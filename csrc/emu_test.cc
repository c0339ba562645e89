/*
 * emu_test.cc: the CUDA kernel bodies (kernels_dev.cuh) run on the host,
 * block by block and thread by thread, against the host C kernels
 * (kernels.c). It checks what a GPU-less machine can check of the CUDA path:
 * the block/segment indexing, the 16-byte pack path and its alignment test,
 * the element tails, the descriptor numbering, the grid-stride loops, the
 * in-place reduce-scatter and the fused all-reduce. (That the GPU's float
 * arithmetic is IEEE, with --fmad=false, is for cuda_test.go on a GPU.)
 *
 * Both sides include elementwise.h, so a mistake in the shared math would
 * pass that comparison: every result is also checked, bit for bit, against
 * a reference written here from the definitions (values decoded by formula,
 * rounded to each format by arithmetic in double, fp32 arithmetic in the
 * order the design fixes). And since x86 does not fault on a misaligned
 * 16-byte access, every vector load and store is checked for alignment.
 *
 *   make cuda-emu        # builds and runs it; prints "N passed, M failed"
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <vector>

static long misaligned;
#define ZC_ALIGNED16(p) (((uintptr_t)(p) & 15) ? (void)misaligned++ : (void)0)
#include "emu_launch.h"
extern "C" {
#include "../kernels.h"
}

static int passed, failed;

static void check(bool ok, const char* what, long a, long b, unsigned got, unsigned want) {
	if (ok) {
		passed++;
		return;
	}
	if (failed++ < 20) fprintf(stderr, "FAIL %s [%ld %ld]: got %#x want %#x\n", what, a, b, got, want);
}

static std::mt19937_64 rng(12345);

static int dsize(int t) { return t == ZERO_F32 ? 4 : 2; }

/* A host buffer with room to start at any alignment. */
struct hbuf {
	std::vector<unsigned char> mem;
	unsigned char* p;
	int dt;
	int64_t n;
	hbuf(int dt_, int64_t n_, int misalign) : mem((size_t)(n_ + 16) * 4 + 64), dt(dt_), n(n_) {
		uintptr_t a = ((uintptr_t)mem.data() + 63) & ~(uintptr_t)63;
		p = (unsigned char*)a + misalign * dsize(dt);
	}
	uint32_t bits(int64_t i) const {
		if (dt == ZERO_F32) {
			uint32_t u;
			memcpy(&u, p + 4 * i, 4);
			return u;
		}
		uint16_t h;
		memcpy(&h, p + 2 * i, 2);
		return h;
	}
	void set(int64_t i, uint32_t u) {
		if (dt == ZERO_F32)
			memcpy(p + 4 * i, &u, 4);
		else {
			uint16_t h = (uint16_t)u;
			memcpy(p + 2 * i, &h, 2);
		}
	}
	void fill(bool wild) {
		std::normal_distribution<float> nd(0.0f, 1.0f);
		for (int64_t i = 0; i < n; i++) {
			if (wild && (rng() & 1)) {
				set(i, (uint32_t)rng());
				continue;
			}
			float v = nd(rng) * ldexpf(1.0f, (int)(rng() % 20) - 10);
			uint32_t u;
			memcpy(&u, &v, 4);
			set(i, dt == ZERO_F32 ? u : dt == ZERO_BF16 ? zero_f32_to_bf16(v) : zero_f32_to_f16(v));
		}
	}
	bool isnan(int64_t i) const {
		uint32_t u = bits(i);
		if (dt == ZERO_F32) return (u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu);
		if (dt == ZERO_BF16) return (u & 0x7f80u) == 0x7f80u && (u & 0x7fu);
		return (u & 0x7c00u) == 0x7c00u && (u & 0x3ffu);
	}
};

static bool same(const hbuf& a, const hbuf& b, int64_t* at) {
	for (int64_t i = 0; i < a.n; i++)
		if (a.bits(i) != b.bits(i) && !(a.isnan(i) && b.isnan(i))) {
			*at = i;
			return false;
		}
	return true;
}

static const int dtypes[3] = {ZERO_F32, ZERO_BF16, ZERO_F16};

/* ---- the independent reference ---------------------------------------------- */

/* The value of bits u in format dt, by formula. */
static double ref_decode(int dt, uint32_t u) {
	if (dt != ZERO_F16) {
		uint32_t w = dt == ZERO_BF16 ? u << 16 : u; /* bf16 is the top half of an fp32 */
		float f;
		memcpy(&f, &w, 4);
		return f;
	}
	int e = (int)((u >> 10) & 31), m = (int)(u & 1023);
	double v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
	return (u & 0x8000u) ? -v : v;
}

/* x rounded to nearest even into a format of p significant bits whose
 * normal exponents run from emin to emax (beyond: inf). */
static double ref_round(double x, int p, int emin, int emax) {
	if (x != x || x == 0 || isinf(x)) return x;
	int e;
	frexp(x, &e); /* |x| in [2^(e-1), 2^e) */
	int q = (e - 1 < emin ? emin : e - 1) - (p - 1);
	double r = ldexp(nearbyint(ldexp(x, -q)), q);
	return fabs(r) >= ldexp(1.0, emax + 1) ? copysign(INFINITY, x) : r;
}

/* What storing the fp32 value v into format dt gives. */
static double ref_store(int dt, float v) {
	return dt == ZERO_F32 ? v : dt == ZERO_BF16 ? ref_round(v, 8, -126, 127) : ref_round(v, 11, -14, 15);
}

/* Bits got in format dt hold the value want (any NaN for a NaN; zeros by sign). */
static bool ref_same(int dt, uint32_t got, double want) {
	double g = ref_decode(dt, got);
	if (want != want) return g != g;
	return g == want && signbit(g) == signbit(want);
}

/* Element i of a segment's source, as fp32, times scale (no multiply at 1). */
static float ref_scaled(int st, const zc_seg& sg, int64_t i, float scale) {
	uint32_t u = 0;
	memcpy(&u, (const char*)sg.ptr + i * dsize(st), (size_t)dsize(st));
	float v = (float)ref_decode(st, u);
	return scale == 1.0f ? v : v * scale;
}

/* A reduction over ranks in rank order, in fp32: sum, sum / n, or max with
 * NaN winning; stored in dt. */
static double ref_reduce(int dt, int op, const std::vector<double>& x) {
	float s = (float)x[0];
	for (size_t k = 1; k < x.size(); k++) {
		float v = (float)x[k];
		s = op == ZERO_MAX ? ((v > s || v != v) ? v : s) : s + v;
	}
	if (op == ZERO_AVG) s = s / (float)x.size();
	return ref_store(dt, s);
}

/* ---- tests ---------------------------------------------------------------- */

struct layout {
	std::vector<hbuf*> src;
	std::vector<zc_seg> segs;
	int64_t total;
};

static layout make_layout(int st, int nseg, int maxlen, bool aligned, bool wild = true) {
	layout l;
	int64_t off = (int64_t)(rng() % 5);
	for (int k = 0; k < nseg; k++) {
		int64_t n = (int64_t)(rng() % (unsigned)(maxlen + 1));
		if (k == 0 && nseg > 1) n = 0; /* an empty segment too */
		if (aligned) off = (off + 7) & ~(int64_t)7;
		hbuf* b = new hbuf(st, n, aligned ? 0 : (int)(rng() % 8));
		b->fill(wild);
		l.src.push_back(b);
		l.segs.push_back(zc_seg{(uintptr_t)b->p, n, off});
		off += n + (int64_t)(rng() % 2) * (int64_t)(rng() % 40);
	}
	l.total = off + 9;
	for (int k = nseg - 1; k > 0; k--) std::swap(l.segs[k], l.segs[rng() % (unsigned)(k + 1)]);
	return l;
}

static void free_layout(layout& l) {
	for (hbuf* b : l.src) delete b;
}

static void test_flatten_accumulate() {
	struct {
		int nseg, maxlen;
		bool aligned;
	} cases[] = {{1, 70000, true}, {1, 20001, false}, {12, 9000, true}, {20, 3000, false}, {150, 2000, true}, {90, 500, false}};
	const float scales[] = {1.0f, 0.125f, 0.3f, -3.75f};
	for (auto& c : cases) {
		for (int st : dtypes) {
			layout l = make_layout(st, c.nseg, c.maxlen, c.aligned);
			std::vector<zc_dseg> d(l.segs.size());
			int64_t blocks = 0;
			int n = zc_build_descs(l.segs.data(), 0, (int)l.segs.size(), d.data(), &blocks);
			for (int dt : dtypes) {
				for (float scale : scales) {
					hbuf want(dt, l.total, 0), got(dt, l.total, 0);
					want.fill(false);
					memcpy(got.p, want.p, (size_t)(l.total * dsize(dt)));
					std::vector<double> ref(l.total);
					std::vector<uint32_t> copied(l.total), is_copy(l.total);
					for (int64_t i = 0; i < l.total; i++) copied[i] = want.bits(i), is_copy[i] = 1;
					for (const zc_seg& sg : l.segs)
						for (int64_t i = 0; i < sg.count; i++) {
							int64_t at = sg.offset + i;
							is_copy[at] = st == dt && scale == 1.0f;
							if (is_copy[at])
								memcpy(&copied[at], (const char*)sg.ptr + i * dsize(st), (size_t)dsize(st));
							else
								ref[at] = ref_store(dt, ref_scaled(st, sg, i, scale));
						}
					zero_flatten(want.p, dt, (const zero_seg*)l.segs.data(), (int)l.segs.size(), st, scale, 0, l.total);
					emu_flatten((char*)got.p, dt, st, d.data(), n, scale, blocks);
					int64_t at = 0;
					bool ok = same(got, want, &at);
					check(ok, "flatten", st * 10 + dt, at, ok ? 0 : got.bits(at), ok ? 0 : want.bits(at));
					for (at = 0; at < l.total; at++) {
						bool good = is_copy[at] ? got.bits(at) == copied[at] : ref_same(dt, got.bits(at), ref[at]);
						if (!good) break;
					}
					ok = at == l.total;
					check(ok, "flatten vs float64 reference", st * 10 + dt, at, ok ? 0 : got.bits(at), 0);
				}
			}
			for (int at : dtypes) {
				for (int first = 0; first <= 1; first++) {
					for (float scale : scales) {
						hbuf want(at, l.total, 0), got(at, l.total, 0);
						want.fill(false);
						memcpy(got.p, want.p, (size_t)(l.total * dsize(at)));
						float flag = 0;
						std::vector<double> ref(l.total);
						bool ref_bad = false;
						for (int64_t i = 0; i < l.total; i++) ref[i] = ref_decode(at, want.bits(i));
						/* the sum in fp32, stored once; the flag from what is stored */
						for (const zc_seg& sg : l.segs)
							for (int64_t i = 0; i < sg.count; i++) {
								float v = ref_scaled(st, sg, i, scale);
								double r = ref_store(at, first ? v : (float)ref[sg.offset + i] + v);
								ref_bad |= isinf(r) || r != r;
								ref[sg.offset + i] = r;
							}
						zero_accumulate(want.p, at, (const zero_seg*)l.segs.data(), (int)l.segs.size(), st, first, scale,
						                &flag, 0, l.total);
						bool bad = emu_accumulate((char*)got.p, at, st, d.data(), n, scale, first, blocks);
						int64_t at_i = 0;
						bool ok = same(got, want, &at_i);
						long what = at * 100 + st * 10 + first;
						check(ok, "accumulate", what, at_i, ok ? 0 : got.bits(at_i), ok ? 0 : want.bits(at_i));
						check(bad == (flag != 0), "accumulate flag", what, 0, bad, flag != 0);
						for (at_i = 0; at_i < l.total && ref_same(at, got.bits(at_i), ref[at_i]); at_i++) {
						}
						ok = at_i == l.total;
						check(ok, "accumulate vs float64 reference", what, at_i, ok ? 0 : got.bits(at_i), 0);
						check(bad == ref_bad, "accumulate flag vs reference", what, 0, bad, ref_bad);
					}
				}
			}
			free_layout(l);
		}
	}
}

/* The flag of a 16-bit accumulator follows the stored value: tame data
 * leaves it down; one sum that is finite in fp32 but rounds to inf (fp16
 * 65504 + 16, bf16 max + half its ulp) raises it, in either half of a word
 * of a 16-byte pack or in a tail, on the host and in the kernel body alike. */
static void test_accumulate16_flag() {
	struct {
		int at, st;
		float acc, src;
	} cases[] = {{ZERO_F16, ZERO_F32, 65504.0f, 16.0f},
	             {ZERO_F16, ZERO_F16, 65504.0f, 16.0f},
	             {ZERO_F16, ZERO_BF16, 65504.0f, 16.0f},
	             {ZERO_BF16, ZERO_F32, 0x1.fep127f, 0x1p119f},
	             {ZERO_BF16, ZERO_BF16, 0x1.fep127f, 0x1p119f}};
	for (auto& c : cases) {
		for (int aligned = 0; aligned <= 1; aligned++) {
			for (int where = -1; where <= 3; where++) { /* none; element 0, 1, an odd one mid-way, the last */
				layout l = make_layout(c.st, 12, 3000, aligned, false);
				hbuf want(c.at, l.total, 0), got(c.at, l.total, 0);
				want.fill(false);
				const zc_seg* sg = &l.segs[0];
				for (const zc_seg& x : l.segs)
					if (x.count > sg->count) sg = &x;
				if (where >= 0 && sg->count > 0) {
					const int64_t pos[4] = {0, 1, (sg->count / 2) | 1, sg->count - 1};
					int64_t i = pos[where] < sg->count ? pos[where] : sg->count - 1;
					want.set(sg->offset + i, c.at == ZERO_F16 ? zero_f32_to_f16(c.acc) : zero_f32_to_bf16(c.acc));
					uint32_t u;
					memcpy(&u, &c.src, 4);
					uint32_t b = c.st == ZERO_F32 ? u : c.st == ZERO_F16 ? zero_f32_to_f16(c.src) : zero_f32_to_bf16(c.src);
					memcpy((char*)sg->ptr + i * dsize(c.st), &b, (size_t)dsize(c.st));
				}
				memcpy(got.p, want.p, (size_t)(l.total * dsize(c.at)));
				std::vector<zc_dseg> d(l.segs.size());
				int64_t blocks = 0;
				int n = zc_build_descs(l.segs.data(), 0, (int)l.segs.size(), d.data(), &blocks);
				float flag = 0;
				zero_accumulate(want.p, c.at, (const zero_seg*)l.segs.data(), (int)l.segs.size(), c.st, 0, 1.0f, &flag, 0,
				                l.total);
				bool bad = emu_accumulate((char*)got.p, c.at, c.st, d.data(), n, 1.0f, 0, blocks);
				int64_t at = 0;
				bool ok = same(got, want, &at);
				long what = c.at * 100 + c.st * 10 + aligned;
				check(ok, "accumulate16 overflow", what, at, ok ? 0 : got.bits(at), ok ? 0 : want.bits(at));
				bool expect = where >= 0 && sg->count > 0;
				check(bad == expect, "accumulate16 overflow flag (kernel body)", what, where, bad, expect);
				check((flag != 0) == expect, "accumulate16 overflow flag (host)", what, where, flag != 0, expect);
				free_layout(l);
			}
		}
	}
}

static void test_reductions() {
	const int worlds[] = {1, 2, 3, 4, 8};
	const int64_t chunks[] = {1, 13, 64, 40000};
	const int ops[] = {ZERO_SUM, ZERO_AVG, ZERO_MAX};
	for (int w : worlds) {
		for (int dt : dtypes) {
			for (int64_t chunk : chunks) {
				for (int op : ops) {
					for (int misalign = 0; misalign <= 1; misalign++) {
						/* reduce-scatter in place: output j is chunk j of rank j's buffer */
						std::vector<hbuf*> host, emu;
						std::vector<uintptr_t> hs, es, ed;
						for (int k = 0; k < w; k++) {
							host.push_back(new hbuf(dt, w * chunk, misalign && k == 1));
							host[k]->fill(true);
							emu.push_back(new hbuf(dt, w * chunk, misalign && k == 1));
							memcpy(emu[k]->p, host[k]->p, (size_t)(w * chunk * dsize(dt)));
							es.push_back((uintptr_t)emu[k]->p);
							ed.push_back((uintptr_t)emu[k]->p + (uintptr_t)(k * chunk * dsize(dt)));
						}
						/* the reference of every output element, before the in-place run */
						std::vector<double> ref((size_t)(w * chunk));
						for (int64_t i = 0; i < w * chunk; i++) {
							std::vector<double> x;
							for (int k = 0; k < w; k++) x.push_back(ref_decode(dt, host[k]->bits(i)));
							ref[i] = ref_reduce(dt, op, x);
						}
						std::vector<hbuf*> want;
						for (int j = 0; j < w; j++) {
							want.push_back(new hbuf(dt, chunk, 0));
							std::vector<uintptr_t> srcs;
							for (int k = 0; k < w; k++) srcs.push_back((uintptr_t)host[k]->p + (uintptr_t)(j * chunk * dsize(dt)));
							zero_reduce(want[j]->p, srcs.data(), w, dt, op, 0, chunk);
						}
						zc_red_arg a;
						zc_red_setup(&a, ed.data(), w, es.data(), w, dt, op, chunk);
						unsigned grid = (rng() & 1) ? 1 : zc_grid(a.vec ? chunk / ZC_PACK : chunk);
						emu_reduce(a, dt, op, grid, false);
						for (int j = 0; j < w; j++) {
							hbuf got(dt, chunk, 0);
							got.p = emu[j]->p + j * chunk * dsize(dt);
							int64_t at = 0;
							bool ok = same(got, *want[j], &at);
							check(ok, "reduce", w * 100 + dt * 10 + op, at, ok ? 0 : got.bits(at), ok ? 0 : want[j]->bits(at));
							for (at = 0; at < chunk && ref_same(dt, got.bits(at), ref[j * chunk + at]); at++) {
							}
							ok = at == chunk;
							check(ok, "reduce vs float64 reference", w * 100 + dt * 10 + op, at, ok ? 0 : got.bits(at), 0);
						}
						/* fused all-reduce over fresh data */
						std::vector<uintptr_t> hb, eb;
						for (int k = 0; k < w; k++) {
							host[k]->fill(true);
							memcpy(emu[k]->p, host[k]->p, (size_t)(w * chunk * dsize(dt)));
							hb.push_back((uintptr_t)host[k]->p);
							eb.push_back((uintptr_t)emu[k]->p);
						}
						for (int64_t i = 0; i < w * chunk; i++) {
							std::vector<double> x;
							for (int k = 0; k < w; k++) x.push_back(ref_decode(dt, host[k]->bits(i)));
							ref[i] = ref_reduce(dt, op, x);
						}
						zero_allreduce_fused(hb.data(), w, dt, op, 0, w * chunk);
						zc_red_setup(&a, eb.data(), 0, eb.data(), w, dt, op, w * chunk);
						grid = (rng() & 1) ? 2 : zc_grid(a.vec ? w * chunk / ZC_PACK : w * chunk);
						emu_reduce(a, dt, op, grid, true);
						for (int k = 0; k < w; k++) {
							int64_t at = 0;
							bool ok = same(*emu[k], *host[k], &at);
							check(ok, "allreduce", w * 100 + dt * 10 + op, at, ok ? 0 : emu[k]->bits(at), ok ? 0 : host[k]->bits(at));
							for (at = 0; at < w * chunk && ref_same(dt, emu[k]->bits(at), ref[at]); at++) {
							}
							ok = at == w * chunk;
							check(ok, "allreduce vs float64 reference", w * 100 + dt * 10 + op, at, ok ? 0 : emu[k]->bits(at), 0);
						}
						for (hbuf* b : host) delete b;
						for (hbuf* b : emu) delete b;
						for (hbuf* b : want) delete b;
					}
				}
			}
		}
	}
}

static void test_sumsq() {
	const int64_t sizes[] = {0, 1, 1000, 1 << 20, 3 * 1000 * 1000 + 5};
	for (int64_t n : sizes) {
		hbuf x(ZERO_F32, n, 0);
		x.fill(false);
		int64_t nb = (n + ZC_THREADS * 16 - 1) / (ZC_THREADS * 16);
		if (nb < 1) nb = 1;
		if (nb > ZC_SUMSQ_MAX_BLOCKS) nb = ZC_SUMSQ_MAX_BLOCKS;
		/* the two kernels of zc_sumsq: per-block trees, then one tree over the blocks */
		std::vector<double> part(nb), s(ZC_THREADS);
		for (int64_t b = 0; b < nb; b++) {
			for (int t = 0; t < ZC_THREADS; t++)
				s[t] = zc_sumsq_thread((const float*)x.p, n, b * ZC_THREADS + t, nb * ZC_THREADS);
			for (int w = ZC_THREADS / 2; w > 0; w >>= 1)
				for (int t = 0; t < w; t++) s[t] = s[t] + s[t + w];
			part[b] = s[0];
		}
		for (int t = 0; t < ZC_THREADS; t++) {
			double acc = 0.0;
			for (int64_t i = t; i < nb; i += ZC_THREADS) acc = acc + part[i];
			s[t] = acc;
		}
		for (int w = ZC_THREADS / 2; w > 0; w >>= 1)
			for (int t = 0; t < w; t++) s[t] = s[t] + s[t + w];
		double want = n ? zero_sumsq((const float*)x.p, 0, n) : 0.0;
		bool ok = fabs(s[0] - want) <= 1e-12 * fabs(want);
		check(ok, "sumsq", (long)n, 0, 0, 0);
		long double ref = 0; /* in another order and precision: the bound covers both roundings */
		for (int64_t i = 0; i < n; i++) ref += (long double)ref_decode(ZERO_F32, x.bits(i)) * ref_decode(ZERO_F32, x.bits(i));
		ok = fabsl(s[0] - ref) <= 1e-12L * ref;
		check(ok, "sumsq vs float64 reference", (long)n, 0, 0, 0);
	}
}

/* gamma_c = c u / (1 - c u), u = 2^-53: the relative error bound of a sum of
 * nonnegative terms in double that each pass through at most c additions. */
static double gamma_d(double c) { return c * ldexp(1.0, -53) / (1 - c * ldexp(1.0, -53)); }

/* The norm in the landing. For every accumulator and source dtype, first or
 * not, scale 1 or not, a 16-byte aligned segment and a misaligned one, and
 * sizes around the chunk (ZC_CHUNK = 8192):
 *  (a) an accumulate launch with part stores the bits (and raises the flag)
 *      it does without;
 *  (b) part[k] has the bits of zc_chunksq over the stored result, and part
 *      past the last chunk is untouched;
 *  (c) each chunk sum, and the chunks' total through zc_sumchunks, is within
 *      a bound of a long double sum of the squares of the stored values
 *      (decoded by formula, ref_decode). The bound: a square of an fp32
 *      value is exact in double (24-bit significands: 48 bits), so the only
 *      errors are additions of nonnegative terms, each term passing through
 *      at most c of them: a thread's ceil(m / ZC_THREADS) and the tree's 8
 *      for a chunk of m elements, plus ceil(chunks / ZC_THREADS) + 8 for the
 *      total; such a sum is within gamma_c of the exact one. The long double
 *      reference (squares exact in its 64-bit significand) is within
 *      terms * 2^-64 of it; both added, with a factor 2 on the latter. A
 *      chunk sum that missed or repeated one element would be off by its
 *      square, about 1/m of the sum: far outside. */
static void test_norm_squares() {
	const int64_t sizes[] = {0, 1, 8191, 8192, 8193, 3 * 8192 + 5, 100003, 262144 + 77};
	const float scales[] = {1.0f, -3.75f};
	const uint64_t sentinel = 0x7ff4dead7ff4deadull; /* a NaN no sum gives */
	for (int64_t n : sizes) {
		for (int aligned = 0; aligned <= 1; aligned++) {
			for (int st : dtypes) {
				hbuf src(st, n, aligned ? 0 : 3);
				src.fill(false);
				const int64_t off = aligned ? 8 : 5; /* the segment's place in acc */
				zc_seg sg = {(uintptr_t)src.p, n, off};
				zc_dseg d[1];
				int64_t blocks = 0;
				int nd = zc_build_descs(&sg, 0, 1, d, &blocks);
				const int64_t chunks = (n + ZC_CHUNK - 1) / ZC_CHUNK;
				check(blocks == chunks, "norm: a block per chunk", (long)n, (long)blocks, 0, 0);
				for (int at : dtypes) {
					for (int first = 0; first <= 1; first++) {
						for (float scale : scales) {
							const long what = (long)n * 10000 + at * 1000 + st * 100 + first * 10 + aligned;
							hbuf plain(at, n + off + 3, 0), with(at, n + off + 3, 0);
							plain.fill(false);
							memcpy(with.p, plain.p, (size_t)((n + off + 3) * dsize(at)));
							std::vector<uint64_t> part(chunks + 1, sentinel), again(chunks + 1, sentinel);
							bool bad0 = emu_accumulate((char*)plain.p, at, st, d, nd, scale, first, blocks);
							bool bad1 = emu_accumulate((char*)with.p, at, st, d, nd, scale, first, blocks, (double*)part.data());
							/* (a) */
							int64_t i = 0;
							while (i < n + off + 3 && plain.bits(i) == with.bits(i)) i++;
							check(i == n + off + 3, "norm: accumulate with part stores the same bits", what, (long)i,
							      i < n + off + 3 ? with.bits(i) : 0, i < n + off + 3 ? plain.bits(i) : 0);
							check(bad0 == bad1, "norm: accumulate with part raises the same flag", what, 0, bad1, bad0);
							/* (b) */
							emu_chunk_squares((const char*)with.p + off * dsize(at), at, n, (double*)again.data());
							int64_t k = 0;
							while (k <= chunks && part[k] == again[k]) k++;
							check(k > chunks, "norm: part = zc_chunksq of the stored values, bit for bit", what, (long)k,
							      k <= chunks ? (unsigned)part[k] : 0, k <= chunks ? (unsigned)again[k] : 0);
							check(part[chunks] == sentinel, "norm: nothing written past the last chunk", what, (long)chunks, 0, 0);
							/* (c) */
							long double total_ref = 0;
							double worst = 0; /* the largest chunk's thread additions */
							bool ok = true;
							for (k = 0; k < chunks && ok; k++) {
								const int64_t lo = k * ZC_CHUNK, hi = lo + ZC_CHUNK < n ? lo + ZC_CHUNK : n, m = hi - lo;
								long double r = 0;
								for (int64_t j = lo; j < hi; j++) {
									const long double v = ref_decode(at, with.bits(off + j));
									r += v * v;
								}
								total_ref += r;
								const double c = (double)((m + ZC_THREADS - 1) / ZC_THREADS) + 8;
								worst = c > worst ? c : worst;
								double got;
								memcpy(&got, &part[k], 8);
								ok = fabsl((long double)got - r) <= (gamma_d(c) + 2 * m * ldexpl(1.0L, -64)) * r;
								check(ok, "norm: chunk sum vs long double reference", what, (long)k, 0, 0);
							}
							double total = -1;
							const zc_crange all = {0, chunks};
							emu_sum_chunks((const double*)part.data(), &all, 1, &total);
							const double c = worst + (double)((chunks + ZC_THREADS - 1) / ZC_THREADS) + 8;
							ok = fabsl((long double)total - total_ref) <= (gamma_d(c) + 2 * (n + chunks) * ldexpl(1.0L, -64)) * total_ref;
							check(ok && (n > 0 || total == 0), "norm: total vs long double reference", what, 0, 0, 0);
						}
					}
				}
			}
		}
	}
}

/* zc_sumchunks over ranges: each block's sum in zc_sumsq_final's order
 * (zc_sum_thread, zc_tree), so a range of all the sums is what
 * zc_sumsq_final gives, and ranges are independent of their neighbours:
 * checked against a long double sum within gamma_c as above. */
static void test_sum_chunks() {
	std::uniform_real_distribution<double> ud(0.0, 1.0);
	const int64_t np = 3000;
	std::vector<double> p(np);
	for (double& x : p) x = ud(rng) * ldexp(1.0, (int)(rng() % 40) - 20);
	std::vector<zc_crange> r = {{0, 0}, {0, 1}, {0, np}, {5, 261}, {1000, 1000}, {7, 2999}, {2999, 3000}, {256, 512}};
	std::vector<double> out(r.size(), -1.0);
	emu_sum_chunks(p.data(), r.data(), (int64_t)r.size(), out.data());
	for (size_t i = 0; i < r.size(); i++) {
		long double ref = 0;
		for (int64_t k = r[i].lo; k < r[i].hi; k++) ref += p[k];
		const double c = (double)((r[i].hi - r[i].lo + ZC_THREADS - 1) / ZC_THREADS) + 8;
		const bool ok = fabsl(out[i] - ref) <= (gamma_d(c) + 2 * (r[i].hi - r[i].lo) * ldexpl(1.0L, -64)) * ref;
		check(ok && (r[i].hi > r[i].lo || out[i] == 0), "sumchunks vs long double reference", (long)i, 0, 0, 0);
	}
}

static void test_descs() {
	/* block numbering: every chunk of every non-empty segment exactly once */
	zc_seg segs[5] = {{1, 0, 0}, {2, ZC_CHUNK, 0}, {3, 1, 0}, {4, 0, 0}, {5, 2 * ZC_CHUNK + 1, 0}};
	zc_dseg d[5];
	int64_t blocks = 0;
	int n = zc_build_descs(segs, 0, 5, d, &blocks);
	check(n == 3 && blocks == 1 + 1 + 3, "descs count", n, blocks, 0, 0);
	for (int64_t b = 0; b < blocks; b++) {
		zc_dseg s = zc_find(d, n, b);
		uintptr_t want = b == 0 ? 2 : b == 1 ? 3 : 5;
		check(s.src == want, "descs find", (long)b, 0, (unsigned)s.src, (unsigned)want);
	}
}

/* The optimizer kernels and unflatten: the CUDA bodies over a launch against
 * the host C kernels, bit for bit, and against float64 from the same state. */
static void test_optimizers() {
	const int n = 40000;
	std::normal_distribution<float> nd(0.0f, 1.0f);
	for (int adam = 0; adam <= 1; adam++) {
		for (int out_dt : dtypes) {
			std::vector<float> p(n), m(n), v(n), vmax(n), g(n);
			for (int i = 0; i < n; i++) {
				p[i] = nd(rng);
				m[i] = nd(rng) * 0.1f;
				v[i] = fabsf(nd(rng)) * 0.01f;
				vmax[i] = v[i] * 1.5f;
				g[i] = nd(rng) * 0.1f;
			}
			/* ranges of varied sizes and settings, a gap at the end */
			std::vector<zero_opt_range> rs;
			for (int64_t off = 0; off < n - 300;) {
				zero_opt_range r;
				memset(&r, 0, sizeof r);
				r.offset = off;
				r.count = 1 + (int64_t)(rng() % 3000);
				/* ranges of several blocks, and whole packs so that the next
				 * range starts aligned too: the kernels' pack path */
				if (rng() % 4 == 0) r.count *= 4;
				if (rng() & 1) r.count = (r.count + 7) & ~(int64_t)7;
				if (r.offset + r.count > n - 300) r.count = n - 300 - r.offset;
				if (adam) {
					r.decay = 1 - 1e-3f * 0.01f * (float)(rng() % 3);
					r.step = 1e-3f / (1 - 0.9f);
					r.beta1c = 0.1f;
					r.beta2 = 0.999f;
					r.beta2c = 0.001f;
					r.bc2sqrt = sqrtf(0.001f);
					r.eps = 1e-8f;
					r.flags = (rng() & 1) ? ZERO_OPT_AMSGRAD : 0;
				} else {
					r.decay = (rng() & 1) ? 1e-4f : 0;
					r.step = 0.05f;
					r.beta1c = (rng() % 3) ? 0.9f : 0;
					r.beta2 = 1 - 0.1f * (float)(rng() % 2);
					r.flags = (rng() & 1) ? ZERO_OPT_FIRST : 0;
					if (r.beta2 == 1 && (rng() & 1)) r.flags |= ZERO_OPT_NESTEROV;
				}
				rs.push_back(r);
				off += r.count;
			}
			hbuf ho(out_dt, n, 0), eo(out_dt, n, 0);
			std::vector<float> hp = p, hm = m, hv = v, hx = vmax, ep = p, em = m, ev = v, ex = vmax;
			const float gs = 0.7f;
			if (adam)
				zero_adamw(hp.data(), hm.data(), hv.data(), hx.data(), g.data(), ho.p, out_dt, rs.data(), (int)rs.size(), gs, 0, n);
			else
				zero_sgd(hp.data(), hm.data(), g.data(), ho.p, out_dt, rs.data(), (int)rs.size(), gs, 0, n);
			std::vector<zc_odesc> ds(rs.size());
			int64_t blocks = 0;
			int nd2 = zc_build_odescs(rs.data(), 0, (int)rs.size(), ds.data(), &blocks);
			emu_opt(adam, ep.data(), g.data(), em.data(), adam ? ev.data() : nullptr, adam ? ex.data() : nullptr, (char*)eo.p,
			        out_dt, ds.data(), nd2, gs, blocks);
			int64_t at = 0;
			bool ok = memcmp(hp.data(), ep.data(), n * 4) == 0 && memcmp(hm.data(), em.data(), n * 4) == 0 &&
			          (!adam || (memcmp(hv.data(), ev.data(), n * 4) == 0 && memcmp(hx.data(), ex.data(), n * 4) == 0)) &&
			          same(eo, ho, &at);
			check(ok, adam ? "adamw" : "sgd", out_dt, at, 0, 0);
			/* float64 from the same state */
			bool good = true;
			for (const zero_opt_range& r : rs) {
				for (int64_t i = r.offset; i < r.offset + r.count && good; i++) {
					double gg = (double)(g[i] * gs), wp = p[i], wm = m[i], wv = v[i], wx = vmax[i];
					if (adam) {
						wp *= r.decay;
						wm += r.beta1c * (gg - wm);
						wv = wv * r.beta2 + r.beta2c * gg * gg;
						double d = wv;
						if (r.flags & ZERO_OPT_AMSGRAD) d = wx = wx > wv ? wx : wv;
						wp -= r.step * (wm / (sqrt(d) / r.bc2sqrt + r.eps));
					} else {
						gg += r.decay * wp;
						if (r.beta1c != 0) {
							wm = (r.flags & ZERO_OPT_FIRST) ? gg : wm * r.beta1c + r.beta2 * gg;
							gg = (r.flags & ZERO_OPT_NESTEROV) ? gg + r.beta1c * wm : wm;
						}
						wp -= r.step * gg;
					}
					double tol = 16 * ldexp(1.0, -24) * (fabs((double)p[i]) + fabs(wp - p[i]) + r.step * fabs(gg));
					good = fabs(hp[i] - wp) <= tol;
					if (!good) at = i;
				}
			}
			check(good, adam ? "adamw vs float64 reference" : "sgd vs float64 reference", out_dt, at, 0, 0);
			bool gap = true;
			for (int i = n - 300; i < n; i++) gap = gap && hp[i] == p[i] && ep[i] == p[i];
			check(gap, "optimizer: elements in no range unchanged", adam, 0, 0, 0);
		}
	}
	/* unflatten: the inverse of flatten, one dtype */
	for (int dt : dtypes) {
		layout l = make_layout(dt, 40, 3000, (rng() & 1) != 0);
		hbuf flat(dt, l.total, 0);
		flat.fill(true);
		std::vector<hbuf*> hd, ed;
		std::vector<zc_seg> hs = l.segs, es = l.segs;
		for (size_t k = 0; k < l.segs.size(); k++) {
			hd.push_back(new hbuf(dt, l.segs[k].count, (int)(rng() % 8)));
			ed.push_back(new hbuf(dt, l.segs[k].count, (int)(rng() % 8)));
			hs[k].ptr = (uintptr_t)hd[k]->p;
			es[k].ptr = (uintptr_t)ed[k]->p;
		}
		zero_unflatten(flat.p, dt, (const zero_seg*)hs.data(), (int)hs.size(), 0, l.total);
		std::vector<zc_dseg> d(es.size());
		int64_t blocks = 0;
		int nd2 = zc_build_descs(es.data(), 0, (int)es.size(), d.data(), &blocks);
		emu_unflatten((const char*)flat.p, dt, d.data(), nd2, blocks);
		bool ok = true;
		for (size_t k = 0; k < hs.size() && ok; k++)
			for (int64_t i = 0; i < hs[k].count && ok; i++)
				ok = hd[k]->bits(i) == flat.bits(hs[k].offset + i) && ed[k]->bits(i) == flat.bits(es[k].offset + i);
		check(ok, "unflatten", dt, 0, 0, 0);
		for (auto* b : hd) delete b;
		for (auto* b : ed) delete b;
		free_layout(l);
	}
}

int main() {
	test_descs();
	test_flatten_accumulate();
	test_accumulate16_flag();
	test_reductions();
	test_sumsq();
	test_norm_squares();
	test_sum_chunks();
	test_optimizers();
	check(misaligned == 0, "16-byte accesses on misaligned addresses", misaligned, 0, 0, 0);
	printf("emu_test: %d passed, %d failed\n", passed, failed);
	return failed != 0;
}
