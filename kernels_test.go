package zero

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"unsafe"
)

// Tests of the host kernels (kernels.c through kernels.go) against references
// written here in Go, independently of elementwise.h: values are decoded by
// formula in float64, rounded to bf16/fp16 by searching a table of every
// representable value, and every fp32 computation is repeated in Go with
// float32 arithmetic in the same order (explicit float32() conversions force
// the rounding of each step, so Go cannot fuse them).
//
// Each run draws fresh random data; the seed is logged, and ZERO_TEST_SEED=n
// repeats a run.

// ---- reference conversions -------------------------------------------------

// refScale is the kernels' v * scale, skipped when scale is 1.
func refScale(v, scale float32) float32 {
	if scale == 1 {
		return v
	}
	return float32(v * scale)
}

// refMax is NaN-propagating max; equal values keep s (the earlier rank).
func refMax(s, x float32) float32 {
	if x != x || x > s {
		return x
	}
	return s // also when s is NaN: x > NaN is false
}

// ---- test buffers --------------------------------------------------------------

// randVal draws a finite value with a random sign and an exponent in
// [emin, emax], with the full fp32 mantissa.
func randVal(rng *rand.Rand, emin, emax int) float32 {
	m := 1 + rng.Float64()
	v := float32(math.Ldexp(m, emin+rng.IntN(emax-emin+1)))
	if rng.IntN(2) == 0 {
		v = -v
	}
	return v
}

// expRange is the exponent range of random data for a dtype: wide, with
// subnormals, but with sums of up to 8 values and a scale of up to 4 finite.
func expRange(dt DType) (int, int) {
	switch dt {
	case FP16:
		return -26, 10
	case BF16:
		return -40, 40
	}
	return -40, 40
}

// fillRand fills b with random values of its dtype; with specials, about one
// element in 64 is ±0, ±inf, NaN or a subnormal of the dtype.
func fillRand(rng *rand.Rand, b *tbuf, specials bool) {
	lo, hi := expRange(b.dt)
	for i := 0; i < b.len(); i++ {
		b.set(i, randVal(rng, lo, hi))
		if specials && rng.IntN(64) == 0 {
			b.setBits(i, randSpecial(rng, b.dt))
		}
	}
}

func randSpecial(rng *rand.Rand, dt DType) uint32 {
	var s []uint32
	switch dt {
	case FP32:
		s = []uint32{0, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x00000001, 0x807fffff}
	case BF16:
		s = []uint32{0, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x0001, 0x807f}
	default:
		s = []uint32{0, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x0001, 0x83ff}
	}
	return s[rng.IntN(len(s))]
}

func epsOf(dt DType) float64 {
	switch dt {
	case BF16:
		return math.Ldexp(1, -8)
	case FP16:
		return math.Ldexp(1, -11)
	}
	return math.Ldexp(1, -24)
}

// tinyOf is the smallest positive value of a dtype: the absolute error a
// rounding into its subnormal range may make.
func tinyOf(dt DType) float64 {
	switch dt {
	case BF16:
		return math.Ldexp(1, -133)
	case FP16:
		return math.Ldexp(1, -24)
	}
	return math.Ldexp(1, -149)
}

func maxFinite(dt DType) float64 {
	switch dt {
	case BF16:
		return refDecodeBF16(0x7f7f)
	case FP16:
		return 65504
	}
	return math.MaxFloat32
}

// near checks a finite result against a float64 reference: |got - want| <=
// rel·scale + abs, where scale bounds the magnitudes that were rounded.
func near(got float32, want, scale, rel, abs float64) bool {
	return math.Abs(float64(got)-want) <= rel*scale+abs
}

// ---- conversions ---------------------------------------------------------------

func TestConvertBF16Exhaustive(t *testing.T) { forEachLevel(t, testConvertBF16Exhaustive) }

func testConvertBF16Exhaustive(t *testing.T) {
	src := newTBuf(BF16, 65536)
	for i := range src.h {
		src.h[i] = uint16(i)
	}
	dst := newTBuf(FP32, 65536)
	castHost(dst.ptr(), FP32, src.ptr(), BF16, 65536, 1)
	bad := 0
	for i := 0; i < 65536; i++ {
		h := uint16(i)
		want := refFromBF16(h)
		got := math.Float32bits(floatFromBF16(h))
		if got != want || dst.bits(i) != want {
			if bad++; bad < 10 {
				t.Errorf("bf16 %#04x -> fp32: scalar %#08x, kernel %#08x, want %#08x (%g)", h, got, dst.bits(i), want, refDecodeBF16(h))
			}
		}
		// round trip: every non-NaN pattern comes back unchanged
		if refDecodeBF16(h) == refDecodeBF16(h) {
			if back := bf16FromFloat(math.Float32frombits(want)); back != h {
				if bad++; bad < 10 {
					t.Errorf("bf16 %#04x round trip gave %#04x", h, back)
				}
			}
		}
	}
}

func TestConvertFP16Exhaustive(t *testing.T) { forEachLevel(t, testConvertFP16Exhaustive) }

func testConvertFP16Exhaustive(t *testing.T) {
	src := newTBuf(FP16, 65536)
	for i := range src.h {
		src.h[i] = uint16(i)
	}
	dst := newTBuf(FP32, 65536)
	castHost(dst.ptr(), FP32, src.ptr(), FP16, 65536, 1)
	bad := 0
	for i := 0; i < 65536; i++ {
		h := uint16(i)
		want := refFromFP16(h)
		got := math.Float32bits(floatFromFP16(h))
		if got != want || dst.bits(i) != want {
			if bad++; bad < 10 {
				t.Errorf("fp16 %#04x -> fp32: scalar %#08x, kernel %#08x, want %#08x (%g)", h, got, dst.bits(i), want, refDecodeFP16(h))
			}
		}
		if v := refDecodeFP16(h); v == v {
			if back := fp16FromFloat(math.Float32frombits(want)); back != h {
				if bad++; bad < 10 {
					t.Errorf("fp16 %#04x round trip gave %#04x", h, back)
				}
			}
		}
	}
}

// edgeFloats are the values where rounding to bf16 and fp16 is easiest to get
// wrong.
func edgeFloats() []float32 {
	f := math.Float32frombits
	var v []float32
	add := func(xs ...float32) {
		for _, x := range xs {
			v = append(v, x, -x)
		}
	}
	add(0, 1, 2, 0.5, 3, float32(math.Inf(1)), math.MaxFloat32, math.SmallestNonzeroFloat32, f(0x007fffff), f(0x00800000))
	// NaN payloads, quiet and signalling, both signs; one whose payload sits
	// only in the low 16 bits (truncation alone would make it inf)
	for _, u := range []uint32{0x7fc00000, 0x7f800001, 0x7f80ffff, 0x7fffffff, 0x7fa00000, 0x7f802000, 0x7f800100} {
		v = append(v, f(u), f(u|0x80000000))
	}
	// fp16: max finite, the overflow boundary, the subnormal range
	add(65504, 65519.99, 65520, 65520.01, 65536, 65535, 70000, 1e10)
	add(float32(math.Ldexp(1, -14)), float32(math.Ldexp(1, -24)), float32(math.Ldexp(1, -25)), float32(math.Ldexp(1, -26)),
		float32(math.Ldexp(1.5, -25)), float32(math.Ldexp(3, -25)), float32(math.Ldexp(1023, -24)), float32(math.Ldexp(1023.5, -24)),
		float32(math.Ldexp(1024, -24)-math.Ldexp(1, -40)), float32(math.Ldexp(1, -15)), float32(math.Ldexp(2047, -25)))
	// bf16: max finite and the point where it rounds to inf
	add(f(0x7f7f0000), f(0x7f7f7fff), f(0x7f7f8000), f(0x7f7fffff), f(0x00010000), f(0x00008000), f(0x00018000), f(0x00007fff))
	// ties to even, both ways, and one ulp either side of each tie
	for _, base := range []uint32{0x3f800000, 0x3f810000, 0x40490000, 0x00400000, 0x7f000000} {
		for _, low := range []uint32{0x8000, 0x7fff, 0x8001, 0x18000, 0x17fff, 0x18001} {
			x := f(base + low)
			v = append(v, x, -x)
		}
	}
	// fp16 ties in the normal range (low 13 bits 0x1000), on even and odd
	// mantissas, and one fp32 ulp either side
	for _, base := range []uint32{0x3f800000, 0x3f802000, 0x447a0000, 0x447a2000, 0x38800000, 0x477fc000} {
		for _, low := range []uint32{0x1000, 0x0fff, 0x1001} {
			x := f(base + low)
			v = append(v, x, -x)
		}
	}
	// fp16 ties in the subnormal range: (k + 1/2) · 2^-24, and neighbours
	for _, k := range []float64{0, 1, 2, 3, 511, 1022, 1023} {
		x := float32(math.Ldexp(k+0.5, -24))
		v = append(v, x, -x, math.Nextafter32(x, 0), math.Nextafter32(x, 1))
	}
	return v
}

func checkRound(t *testing.T, what string, xs []float32, got []uint16, ref func(float32) uint16, bad *int) {
	t.Helper()
	for i, x := range xs {
		if want := ref(x); got[i] != want {
			if *bad++; *bad < 20 {
				t.Errorf("%s(%g = %#08x) = %#04x, want %#04x", what, x, math.Float32bits(x), got[i], want)
			}
		}
	}
}

// convertAll converts xs with the scalar converter and with the vectorised
// cast kernel; both must agree with the reference.
func convertAll(t *testing.T, xs []float32, bad *int) {
	t.Helper()
	src := newTBuf(FP32, len(xs))
	copy(src.f, xs)
	for _, c := range []struct {
		name   string
		dt     DType
		scalar func(float32) uint16
		ref    func(float32) uint16
	}{
		{"bf16FromFloat", BF16, bf16FromFloat, refToBF16},
		{"fp16FromFloat", FP16, fp16FromFloat, refToFP16},
	} {
		s := make([]uint16, len(xs))
		for i, x := range xs {
			s[i] = c.scalar(x)
		}
		checkRound(t, c.name, xs, s, c.ref, bad)
		dst := newTBuf(c.dt, len(xs))
		castHost(dst.ptr(), c.dt, src.ptr(), FP32, len(xs), 1)
		checkRound(t, "cast fp32->"+c.dt.String(), xs, dst.h, c.ref, bad)
	}
}

func TestConvertEdges(t *testing.T) { forEachLevel(t, testConvertEdges) }

func testConvertEdges(t *testing.T) {
	bad := 0
	xs := edgeFloats()
	convertAll(t, xs, &bad)
	// a few hand-checked values, so the reference itself is checked too
	for _, c := range []struct {
		x    float32
		bf16 uint16
		fp16 uint16
	}{
		{1, 0x3f80, 0x3c00},
		{-2, 0xc000, 0xc000},
		{65504, 0x4780, 0x7bff},
		{65519.99, 0x4780, 0x7bff},
		{65520, 0x4780, 0x7c00},
		{float32(math.Ldexp(1, -24)), 0x3380, 0x0001},
		{float32(math.Ldexp(1, -25)), 0x3300, 0x0000},             // tie -> even 0
		{float32(math.Ldexp(3, -25)), 0x33c0, 0x0002},             // tie -> even 2
		{float32(math.Ldexp(1, -25) * 1.0000001), 0x3300, 0x0001}, // just above the tie
		{math.Float32frombits(0x3f808000), 0x3f80, 0x3c04},        // bf16 tie -> even (down)
		{math.Float32frombits(0x3f818000), 0x3f82, 0x3c0c},        // bf16 tie -> even (up)
		{math.Float32frombits(0x7f7fffff), 0x7f80, 0x7c00},        // max fp32 -> inf
		{math.Float32frombits(0x7f800001), 0x7fc0, 0x7e00},        // sNaN -> qNaN
		{math.Float32frombits(0xff800001), 0xffc0, 0xfe00},        // sign kept
		{float32(math.Copysign(0, -1)), 0x8000, 0x8000},           // -0
		{math.Float32frombits(0x00000001), 0x0000, 0x0000},        // fp32 subnormal
		{float32(math.Ldexp(1023.5, -24)), 0x3880, 0x0400},        // top subnormal rounds up to min normal
	} {
		if g := bf16FromFloat(c.x); g != c.bf16 || refToBF16(c.x) != c.bf16 {
			t.Errorf("bf16(%g): got %#04x, reference %#04x, want %#04x", c.x, g, refToBF16(c.x), c.bf16)
		}
		if g := fp16FromFloat(c.x); g != c.fp16 || refToFP16(c.x) != c.fp16 {
			t.Errorf("fp16(%g): got %#04x, reference %#04x, want %#04x", c.x, g, refToFP16(c.x), c.fp16)
		}
	}
}

func TestConvertRandom(t *testing.T) { forEachLevel(t, testConvertRandom) }

func testConvertRandom(t *testing.T) {
	rng := testRNG(t)
	n := 1 << 20
	if !fullSize() {
		n = 1 << 16
	}
	bad := 0
	// random bit patterns: every exponent, NaNs and infs included
	xs := make([]float32, n)
	for i := range xs {
		xs[i] = math.Float32frombits(rng.Uint32())
	}
	convertAll(t, xs, &bad)
	// values in and around the fp16 range, and near ties: low bits zeroed
	// then one of them set, so exact ties and their neighbours are common
	for i := range xs {
		u := math.Float32bits(randVal(rng, -27, 17))
		switch rng.IntN(4) {
		case 0:
			u &^= 0x1fff
			u |= uint32(rng.IntN(2)) << 12 // fp16 halfway bit
		case 1:
			u &^= 0xffff
			u |= uint32(rng.IntN(2)) << 15 // bf16 halfway bit
		}
		xs[i] = math.Float32frombits(u)
	}
	convertAll(t, xs, &bad)
}

// ---- ISA levels ------------------------------------------------------------------

// Every ISA level gives the same bits as the baseline for every kernel and
// dtype, on random data with specials and arbitrary bit patterns. NaN
// payloads must match too where one NaN passes through (conversions and
// scaling); where two NaNs meet in an add (accumulate, reductions) which
// payload survives depends on the operand order the compiler picks, so
// there only NaN-ness must match.
func TestKernelLevelsAgree(t *testing.T) {
	withoutRace(t)
	rng := testRNG(t)
	best := setKernelLevel(-1)
	defer setKernelLevel(-1)
	t.Logf("ISA levels 0..%d", best)
	n := 50_000 + rng.IntN(1000)
	seed := rng.Uint64()
	type output struct {
		b     *tbuf
		exact bool // NaN payloads must match
		name  string
	}
	run := func() (out []output, sumsq float64) {
		r := rand.New(rand.NewPCG(seed, 7)) // the same inputs at every level
		for _, st := range allDTypes {
			src := newTBuf(st, n)
			fillRand(r, src, true)
			for i := 0; i < n; i += 5 {
				src.setBits(i, r.Uint32()) // any bits: NaN payloads, subnormals, huge values
			}
			for _, dt := range allDTypes {
				for _, scale := range []float32{1, 0.3} {
					dst := newTBuf(dt, n)
					castHost(dst.ptr(), dt, src.ptr(), st, n, scale)
					out = append(out, output{dst, true, fmt.Sprintf("cast %v->%v scale %g", st, dt, scale)})
				}
			}
			acc := newTBuf(FP32, n)
			fillRand(r, acc, true)
			accumulateHost(acc.ptr(), FP32, []segment{{ptr: src.ptr(), count: int64(n)}}, st, false, 0.7, 0)
			out = append(out, output{acc, false, fmt.Sprintf("accumulate %v", st)})
			for _, at := range halfDTypes {
				acc := newTBuf(at, n)
				fillRand(r, acc, true)
				accumulateHost(acc.ptr(), at, []segment{{ptr: src.ptr(), count: int64(n)}}, st, false, 0.7, 0)
				out = append(out, output{acc, false, fmt.Sprintf("accumulate %v into %v", st, at)})
			}
			for _, op := range allOps {
				bufs := make([]uintptr, 3)
				keep := make([]*tbuf, 3)
				for k := range bufs {
					keep[k] = newTBuf(st, n)
					fillRand(r, keep[k], true)
					bufs[k] = keep[k].ptr()
				}
				dst := newTBuf(st, n)
				reduceHost(dst.ptr(), bufs, st, op, 0, n)
				allReduceFusedHost(bufs, st, op, 0, n)
				out = append(out, output{dst, false, fmt.Sprintf("reduce %v %v", st, op)})
				for k := range keep {
					out = append(out, output{keep[k], false, fmt.Sprintf("all-reduce %v %v rank %d", st, op, k)})
				}
			}
		}
		x := newTBuf(FP32, n)
		fillRand(r, x, false)
		return out, sumSquaresHost(x.ptr(), n)
	}
	setKernelLevel(0)
	base, baseSq := run()
	for l := 1; l <= best; l++ {
		setKernelLevel(l)
		got, sq := run()
		if sq != baseSq {
			t.Errorf("level %d: sum of squares %v, level 0 gave %v", l, sq, baseSq)
		}
		for k, o := range base {
			g := got[k].b
			for i := 0; i < o.b.len(); i++ {
				want, have := o.b.bits(i), g.bits(i)
				if have == want || (!o.exact && sameBits(o.b.dt, have, want)) {
					continue
				}
				t.Fatalf("level %d, %s, element %d: %#x, level 0 gave %#x", l, o.name, i, have, want)
			}
		}
	}
}

// ---- parallel split ----------------------------------------------------------

func TestKernelParallelRange(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, procs := range []int{1, 2, 3, 7} {
		runtime.GOMAXPROCS(procs)
		for _, n := range []int{0, 1, 63, parallelThreshold - 1, parallelThreshold, parallelThreshold + 1, 1_000_003} {
			seen := make([]int32, n)
			var parts [maxParts][2]int
			np := parallelParts(n, func(k, lo, hi int) {
				parts[k] = [2]int{lo, hi}
				for i := lo; i < hi; i++ {
					seen[i]++
				}
			})
			for i, c := range seen {
				if c != 1 {
					t.Fatalf("procs %d n %d: element %d covered %d times", procs, n, i, c)
				}
			}
			for k := 0; k < np; k++ {
				if lo := parts[k][0]; lo%parallelAlign != 0 {
					t.Errorf("procs %d n %d: part %d starts at %d, not a multiple of %d", procs, n, k, lo, parallelAlign)
				}
			}
			if n >= parallelThreshold && np != procs {
				t.Errorf("procs %d n %d: %d parts", procs, n, np)
			}
			if n > 0 && n < parallelThreshold && np != 1 {
				t.Errorf("procs %d n %d: %d parts below the threshold", procs, n, np)
			}
		}
	}
}

// ---- flatten, accumulate, cast -------------------------------------------------

// segLayout is a batch of sources placed in a flat buffer with gaps.
type segLayout struct {
	srcs  []*tbuf
	segs  []segment
	total int
}

func makeSegLayout(rng *rand.Rand, dt DType, sizes []int, specials bool) *segLayout {
	l := &segLayout{}
	off := rng.IntN(5)
	for _, n := range sizes {
		b := newTBuf(dt, n)
		fillRand(rng, b, specials)
		l.srcs = append(l.srcs, b)
		l.segs = append(l.segs, segment{ptr: b.ptr(), count: int64(n), offset: int64(off)})
		off += n + rng.IntN(3)*rng.IntN(70) // sometimes a gap
	}
	l.total = off + rng.IntN(7)
	// report the segments out of flat order, as arrival order would
	rng.Shuffle(len(l.segs), func(i, j int) {
		l.segs[i], l.segs[j] = l.segs[j], l.segs[i]
		l.srcs[i], l.srcs[j] = l.srcs[j], l.srcs[i]
	})
	return l
}

// covering returns the source and index of flat element j, or nil.
func (l *segLayout) covering(j int) (*tbuf, int) {
	for k, s := range l.segs {
		if int64(j) >= s.offset && int64(j) < s.offset+s.count {
			return l.srcs[k], j - int(s.offset)
		}
	}
	return nil, 0
}

func randSizes(rng *rand.Rand, k, max int) []int {
	s := make([]int, k)
	for i := range s {
		s[i] = rng.IntN(max + 1)
	}
	return s
}

var testScales = []float32{1, 0.125, 0.3, -3.75}

const sentinel = 12345.0

func TestFlatten(t *testing.T) { forEachLevel(t, testFlatten) }

func testFlatten(t *testing.T) {
	rng := testRNG(t)
	for _, st := range allDTypes {
		for _, dt := range allDTypes {
			for _, scale := range testScales {
				name := fmt.Sprintf("%v->%v/scale=%g", st, dt, scale)
				l := makeSegLayout(rng, st, randSizes(rng, 1+rng.IntN(9), 300), true)
				dst := newTBuf(dt, l.total)
				for j := 0; j < l.total; j++ {
					dst.set(j, sentinel)
				}
				whole := dst.clone()
				flattenHost(whole.ptr(), dt, l.segs, st, scale)
				// the same work in ragged [lo, hi) pieces
				for lo := 0; lo < l.total; {
					hi := min(l.total, lo+1+rng.IntN(97))
					flattenRange(dst.ptr(), dt, l.segs, st, scale, int64(lo), int64(hi))
					lo = hi
				}
				checkFlat(t, name, l, dst, whole, scale)
			}
		}
	}
}

func checkFlat(t *testing.T, name string, l *segLayout, dst, whole *tbuf, scale float32) {
	t.Helper()
	bad := 0
	for j := 0; j < l.total && bad < 10; j++ {
		if dst.bits(j) != whole.bits(j) {
			bad++
			t.Errorf("%s: element %d: split calls gave %#x, one call %#x", name, j, dst.bits(j), whole.bits(j))
		}
		src, i := l.covering(j)
		if src == nil {
			if dst.bits(j) != refEncode(dst.dt, sentinel) {
				bad++
				t.Errorf("%s: element %d in a gap was written: %#x", name, j, dst.bits(j))
			}
			continue
		}
		x := src.val(i)
		v := refScale(x, scale)
		want := refEncode(dst.dt, v)
		if !sameBits(dst.dt, dst.bits(j), want) {
			bad++
			t.Errorf("%s: element %d: src %g (%#x) -> %#x, want %#x", name, j, x, src.bits(i), dst.bits(j), want)
			continue
		}
		// float64 sanity check for finite, in-range values
		w64 := float64(x) * float64(scale)
		if g := dst.val(j); !math.IsInf(w64, 0) && w64 == w64 && math.Abs(w64) < maxFinite(dst.dt)/2 {
			if !near(g, w64, math.Abs(w64), 2*math.Ldexp(1, -24)+epsOf(dst.dt), tinyOf(dst.dt)+tinyOf(FP32)) {
				bad++
				t.Errorf("%s: element %d: %g, float64 reference %g", name, j, g, w64)
			}
		}
	}
}

// A signalling NaN copied with scale 1 keeps its bits (the multiply is
// skipped), and the result does not depend on how many cores split the work.
func TestFlattenCopyAndParallel(t *testing.T) { forEachLevel(t, testFlattenCopyAndParallel) }

func testFlattenCopyAndParallel(t *testing.T) {
	rng := testRNG(t)
	src := newTBuf(FP32, 4)
	src.f[0] = math.Float32frombits(0x7f800001)
	src.f[1] = math.Float32frombits(0xffa00000)
	dst := newTBuf(FP32, 4)
	flattenHost(dst.ptr(), FP32, []segment{{ptr: src.ptr(), count: 4}}, FP32, 1)
	for i := range 4 {
		if dst.bits(i) != src.bits(i) {
			t.Errorf("fp32 copy changed bits %#x -> %#x", src.bits(i), dst.bits(i))
		}
	}

	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, st := range allDTypes {
		for _, dt := range allDTypes {
			l := makeSegLayout(rng, st, []int{rng.IntN(200), parallelThreshold/2 + rng.IntN(1000), rng.IntN(20_000), parallelThreshold / 2}, true)
			var first *tbuf
			procsList := []int{1, 2, 3}
			if !fullSize() {
				procsList = []int{2}
			}
			for _, procs := range procsList {
				runtime.GOMAXPROCS(procs)
				dst := newTBuf(dt, l.total)
				for j := 0; j < l.total; j++ {
					dst.set(j, sentinel)
				}
				flattenHost(dst.ptr(), dt, l.segs, st, 0.5)
				if first == nil {
					first = dst
					checkFlat(t, fmt.Sprintf("%v->%v large", st, dt), l, dst, dst, 0.5)
					continue
				}
				for j := 0; j < l.total; j++ {
					if dst.bits(j) != first.bits(j) {
						t.Fatalf("%v->%v: GOMAXPROCS %d changed element %d", st, dt, procs, j)
					}
				}
			}
		}
	}
}

func TestAccumulate(t *testing.T) { forEachLevel(t, testAccumulate) }

func testAccumulate(t *testing.T) {
	rng := testRNG(t)
	for _, st := range allDTypes {
		for _, first := range []bool{true, false} {
			for _, scale := range testScales {
				for _, large := range []bool{false, true} {
					if large && !fullSize() && scale != testScales[1] {
						continue
					}
					name := fmt.Sprintf("%v/first=%v/scale=%g/large=%v", st, first, scale, large)
					specials := rng.IntN(2) == 0
					sizes := randSizes(rng, 1+rng.IntN(6), 300)
					if large { // past parallelThreshold, so the work is split
						sizes = []int{rng.IntN(1000), parallelThreshold + rng.IntN(30_000), rng.IntN(1000)}
					}
					l := makeSegLayout(rng, st, sizes, specials)
					acc := newTBuf(FP32, l.total)
					fillRand(rng, acc, false)
					if first {
						for j := range acc.f {
							acc.f[j] = float32(math.NaN()) // a copy must not read acc
						}
					}
					before := acc.clone()
					flagBuf := newTBuf(FP32, 1)
					if rng.IntN(2) == 0 {
						accumulateHost(acc.ptr(), FP32, l.segs, st, first, scale, flagBuf.ptr())
					} else {
						// ragged pieces, one flag per piece, ORed
						for lo := 0; lo < l.total; {
							hi := min(l.total, lo+1+rng.IntN(l.total/3+1))
							var f float32
							accumulateRange(acc.ptr(), FP32, l.segs, st, first, scale, &f, int64(lo), int64(hi))
							if f != 0 {
								flagBuf.f[0] = f
							}
							lo = hi
						}
					}
					checkAcc(t, name, l, acc, before, first, scale, flagBuf.f[0])
				}
			}
		}
	}
}

func checkAcc(t *testing.T, name string, l *segLayout, acc, before *tbuf, first bool, scale, flag float32) {
	t.Helper()
	bad := 0
	nonFinite := false
	for j := 0; j < l.total; j++ {
		src, i := l.covering(j)
		if src == nil {
			if acc.bits(j) != before.bits(j) && bad < 10 {
				bad++
				t.Errorf("%s: element %d in a gap was written", name, j)
			}
			continue
		}
		x := src.val(i)
		v := refScale(x, scale)
		want := v
		if !first {
			want = float32(before.f[j] + v)
		}
		if math.IsInf(float64(want), 0) || want != want {
			nonFinite = true
		}
		if !sameBits(FP32, acc.bits(j), math.Float32bits(want)) && bad < 10 {
			bad++
			t.Errorf("%s: element %d: acc %g + src %g -> %g, want %g", name, j, before.f[j], x, acc.f[j], want)
			continue
		}
		if w64 := float64(x) * float64(scale); want == want && !math.IsInf(float64(want), 0) {
			base := 0.0
			if !first {
				base = float64(before.f[j])
			}
			if !near(acc.f[j], base+w64, math.Abs(base)+math.Abs(w64), 2*math.Ldexp(1, -24), 2*tinyOf(FP32)) && bad < 10 {
				bad++
				t.Errorf("%s: element %d: %g, float64 reference %g", name, j, acc.f[j], base+w64)
			}
		}
	}
	if nonFinite != (flag != 0) {
		t.Errorf("%s: flag %g, but non-finite results: %v", name, flag, nonFinite)
	}
}

// The flag goes up for inf, NaN and overflow in the add, in any part of a
// parallel split, and stays down otherwise; a zero flag address is allowed.
func TestAccumulateFlag(t *testing.T) { forEachLevel(t, testAccumulateFlag) }

func testAccumulateFlag(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(3)
	n := 500_000
	for _, c := range []struct {
		name  string
		src   uint32 // bits placed at position pos
		acc   float32
		first bool
		want  bool
	}{
		{"finite", math.Float32bits(1), 1, false, false},
		{"inf", 0x7f800000, 1, false, true},
		{"-inf first", 0xff800000, 1, true, true},
		{"nan", 0x7fc00000, 1, false, true},
		{"overflow in add", math.Float32bits(3e38), 3e38, false, true},
		{"overflow in copy is none", math.Float32bits(3e38), 3e38, true, false},
		{"acc already inf, copy", math.Float32bits(1), float32(math.Inf(1)), true, false},
	} {
		for _, pos := range []int{0, n / 2, n - 1} {
			src := newTBuf(FP32, n)
			acc := newTBuf(FP32, n)
			for i := range n {
				src.f[i] = 1
				acc.f[i] = 0
			}
			src.setBits(pos, c.src)
			acc.f[pos] = c.acc
			flag := newTBuf(FP32, 1)
			segs := []segment{{ptr: src.ptr(), count: int64(n)}}
			accumulateHost(acc.ptr(), FP32, segs, FP32, c.first, 1, flag.ptr())
			if (flag.f[0] != 0) != c.want {
				t.Errorf("%s at %d: flag %g, want raised=%v", c.name, pos, flag.f[0], c.want)
			}
			if flag.f[0] != 0 && flag.f[0] != 1 {
				t.Errorf("%s: flag %g, want 1", c.name, flag.f[0])
			}
			accumulateHost(acc.ptr(), FP32, segs, FP32, c.first, 1, 0) // no flag: must not crash
		}
	}
	// the kernel never clears a raised flag
	src := newTBuf(FP32, 10)
	acc := newTBuf(FP32, 10)
	flag := newTBuf(FP32, 1)
	flag.f[0] = 1
	accumulateHost(acc.ptr(), FP32, []segment{{ptr: src.ptr(), count: 10}}, FP32, false, 1, flag.ptr())
	if flag.f[0] != 1 {
		t.Errorf("a raised flag was cleared")
	}
}

// ---- accumulate into a 16-bit accumulator ------------------------------------------

// halfDTypes are the 16-bit accumulator dtypes.
var halfDTypes = []DType{BF16, FP16}

// topBits is the exponent field of a 16-bit dtype: all ones is inf or NaN.
func topBits(dt DType) uint32 {
	if dt == BF16 {
		return 0x7f80
	}
	return 0x7c00
}

// fillForAcc refills a layout's sources with values whose sums stay finite in
// an accumulator of dtype at (an fp16 accumulator overflows on fp32 or bf16
// data of the full range); with specials, about one in 64 is special.
func fillForAcc(rng *rand.Rand, l *segLayout, at DType, specials bool) {
	lo, hi := expRange(at)
	for _, b := range l.srcs {
		slo, shi := expRange(b.dt)
		for i := 0; i < b.len(); i++ {
			b.set(i, randVal(rng, max(lo, slo), min(hi, shi)))
			if specials && rng.IntN(64) == 0 {
				b.setBits(i, randSpecial(rng, b.dt))
			}
		}
	}
}

// Copy-vs-add into a bf16 or fp16 accumulator: every element summed in fp32
// and rounded once, the flag raised when a stored value is inf or NaN; in one
// call, split across cores, and in ragged pieces.
func TestAccumulate16(t *testing.T) { forEachLevel(t, testAccumulate16) }

func testAccumulate16(t *testing.T) {
	rng := testRNG(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, at := range halfDTypes {
		for _, st := range allDTypes {
			for _, first := range []bool{true, false} {
				for _, scale := range testScales {
					for _, large := range []bool{false, true} {
						if large && !fullSize() && scale != testScales[2] {
							continue
						}
						name := fmt.Sprintf("%v+=%v/first=%v/scale=%g/large=%v", at, st, first, scale, large)
						specials := rng.IntN(2) == 0
						// odd sizes and offsets, some past a kernel block (512)
						sizes := randSizes(rng, 1+rng.IntN(6), 1100)
						if large {
							sizes = []int{rng.IntN(1000), parallelThreshold + rng.IntN(30_000), rng.IntN(1000)}
							runtime.GOMAXPROCS(2 + rng.IntN(2))
						}
						l := makeSegLayout(rng, st, sizes, false)
						fillForAcc(rng, l, at, specials)
						acc := newTBuf(at, l.total)
						fillRand(rng, acc, specials)
						if first {
							for j := range acc.h {
								acc.h[j] = uint16(topBits(at)) | 0x41 // NaN: a copy must not read acc
							}
						}
						before := acc.clone()
						flagBuf := newTBuf(FP32, 1)
						if rng.IntN(2) == 0 {
							accumulateHost(acc.ptr(), at, l.segs, st, first, scale, flagBuf.ptr())
						} else {
							for lo := 0; lo < l.total; {
								hi := min(l.total, lo+1+rng.IntN(l.total/3+1))
								var f float32
								accumulateRange(acc.ptr(), at, l.segs, st, first, scale, &f, int64(lo), int64(hi))
								if f != 0 {
									flagBuf.f[0] = f
								}
								lo = hi
							}
						}
						checkAcc16(t, name, l, acc, before, first, scale, flagBuf.f[0])
					}
				}
			}
		}
	}
}

// checkAcc16 checks acc against the fp32 sum rounded once (the reference
// conversions of reference_test.go), against float64 within half an ulp of
// the accumulator's dtype plus the fp32 roundings, and the flag against the
// expected stored values.
func checkAcc16(t *testing.T, name string, l *segLayout, acc, before *tbuf, first bool, scale, flag float32) {
	t.Helper()
	at := acc.dt
	bad := 0
	wantFlag := false
	for j := 0; j < l.total; j++ {
		src, i := l.covering(j)
		if src == nil {
			if acc.bits(j) != before.bits(j) && bad < 10 {
				bad++
				t.Errorf("%s: element %d in a gap was written", name, j)
			}
			continue
		}
		x := src.val(i)
		v := refScale(x, scale)
		sum := v
		old := before.val(j)
		if !first {
			sum = float32(old + v)
		}
		want := refEncode(at, sum)
		if want&topBits(at) == topBits(at) {
			wantFlag = true
		}
		if !sameBits(at, acc.bits(j), want) {
			if bad++; bad <= 10 {
				t.Errorf("%s: element %d: acc %#x + src %#x -> %#x, want %#x (fp32 sum %g)", name, j, before.bits(j),
					src.bits(i), acc.bits(j), want, sum)
			}
			continue
		}
		if want&topBits(at) == topBits(at) {
			continue
		}
		base, w64 := 0.0, float64(x)*float64(scale)
		if !first {
			base = float64(old)
		}
		// half an ulp of the dtype, two fp32 roundings (scale, add), and in
		// the subnormal ranges half the dtype's smallest step
		rel := unitRoundoff(at) + 3*unitRoundoff(FP32)
		if !near(acc.val(j), base+w64, math.Abs(base)+math.Abs(w64), rel, tinyOf(at)/2+2*tinyOf(FP32)) {
			if bad++; bad <= 10 {
				t.Errorf("%s: element %d: %g, float64 reference %g", name, j, acc.val(j), base+w64)
			}
		}
	}
	if wantFlag != (flag != 0) {
		t.Errorf("%s: flag %g, but a stored value is inf or NaN: %v", name, flag, wantFlag)
	}
	if flag != 0 && flag != 1 {
		t.Errorf("%s: flag %g, want 1", name, flag)
	}
}

// The flag of a 16-bit accumulator follows the stored value: a finite fp32
// sum that rounds to inf raises it, one that rounds to the largest finite
// value does not; NaN and inf sources raise it in any part of a split.
func TestAccumulate16Flag(t *testing.T) { forEachLevel(t, testAccumulate16Flag) }

func testAccumulate16Flag(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(3)
	n := 500_000
	if !fullSize() {
		n = 3001
	}
	bf16Max := float32(refDecodeBF16(0x7f7f))
	halfULP := float32(math.Ldexp(1, 119)) // half the gap below bf16's inf
	for _, c := range []struct {
		name  string
		at    DType
		acc   float32
		src   uint32 // fp32 bits placed at position pos
		first bool
		scale float32
		stor  uint16 // the stored value expected at pos
		want  bool
	}{
		{"fp16 65504+16 rounds to inf", FP16, 65504, math.Float32bits(16), false, 1, 0x7c00, true},
		{"fp16 65504+15 rounds to 65504", FP16, 65504, math.Float32bits(15), false, 1, 0x7bff, false},
		{"fp16 -65504-8*2 scaled", FP16, -65504, math.Float32bits(-8), false, 2, 0xfc00, true},
		{"fp16 copy of 65520 is inf", FP16, 0, math.Float32bits(65520), true, 1, 0x7c00, true},
		{"fp16 copy of 65519 is finite", FP16, 0, math.Float32bits(65519), true, 1, 0x7bff, false},
		{"fp16 nan source", FP16, 1, 0x7fc00000, false, 1, 0x7e00, true},
		{"fp16 inf source", FP16, 1, 0xff800000, true, 1, 0xfc00, true},
		{"fp16 finite", FP16, 1, math.Float32bits(2), false, 1, 0x4200, false},
		{"bf16 max+half ulp rounds to inf", BF16, bf16Max, math.Float32bits(halfULP), false, 1, 0x7f80, true},
		{"bf16 max+less stays", BF16, bf16Max, math.Float32bits(halfULP / 2), false, 1, 0x7f7f, false},
		{"bf16 nan source", BF16, 1, 0xffc00000, false, 0.5, 0xffc0, true},
		{"bf16 finite", BF16, 1, math.Float32bits(1), false, 1, 0x4000, false},
	} {
		for _, pos := range []int{0, n / 2, n - 1} {
			src := newTBuf(FP32, n)
			acc := newTBuf(c.at, n)
			for i := range n {
				src.f[i] = 1
			}
			src.setBits(pos, c.src)
			acc.set(pos, c.acc)
			flag := newTBuf(FP32, 1)
			segs := []segment{{ptr: src.ptr(), count: int64(n)}}
			accumulateHost(acc.ptr(), c.at, segs, FP32, c.first, c.scale, flag.ptr())
			if (flag.f[0] != 0) != c.want {
				t.Errorf("%s at %d: flag %g, want raised=%v", c.name, pos, flag.f[0], c.want)
			}
			if got := acc.h[pos]; !sameBits(c.at, uint32(got), uint32(c.stor)) {
				t.Errorf("%s at %d: stored %#x, want %#x", c.name, pos, got, c.stor)
			}
		}
	}
	// a NaN already in the accumulator: an add raises the flag, a copy does not
	for _, at := range halfDTypes {
		for _, first := range []bool{false, true} {
			src := newTBuf(BF16, 700)
			acc := newTBuf(at, 700)
			acc.h[333] = uint16(topBits(at)) | 1
			flag := newTBuf(FP32, 1)
			accumulateHost(acc.ptr(), at, []segment{{ptr: src.ptr(), count: 700}}, BF16, first, 1, flag.ptr())
			if (flag.f[0] != 0) == first {
				t.Errorf("%v acc with a NaN, first=%v: flag %g", at, first, flag.f[0])
			}
		}
	}
}

func TestCast(t *testing.T) { forEachLevel(t, testCast) }

func testCast(t *testing.T) {
	rng := testRNG(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, st := range allDTypes {
		for _, dt := range allDTypes {
			for _, scale := range testScales {
				for _, n := range []int{1 + rng.IntN(200), parallelThreshold + rng.IntN(30_000)} {
					if n > 200 && !fullSize() && scale != testScales[2] {
						continue
					}
					runtime.GOMAXPROCS(1 + rng.IntN(3))
					name := fmt.Sprintf("%v->%v/scale=%g/n=%d", st, dt, scale, n)
					src := newTBuf(st, n)
					fillRand(rng, src, true)
					dst := newTBuf(dt, n)
					castHost(dst.ptr(), dt, src.ptr(), st, n, scale)
					// ragged pieces with lo > 0 over a second buffer
					dst2 := newTBuf(dt, n)
					for lo := 0; lo < n; {
						hi := min(n, lo+1+rng.IntN(n/5+3))
						castRange(dst2.ptr(), dt, src.ptr(), st, scale, int64(lo), int64(hi))
						lo = hi
					}
					bad := 0
					for i := 0; i < n && bad < 10; i++ {
						want := refEncode(dt, refScale(src.val(i), scale))
						if !sameBits(dt, dst.bits(i), want) || dst2.bits(i) != dst.bits(i) {
							bad++
							t.Errorf("%s: element %d: src %#x -> %#x (pieces %#x), want %#x", name, i, src.bits(i), dst.bits(i), dst2.bits(i), want)
						}
					}
				}
			}
		}
	}
}

// ---- sum of squares ----------------------------------------------------------------

func TestSumSq(t *testing.T) { forEachLevel(t, testSumSq) }

func testSumSq(t *testing.T) {
	rng := testRNG(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, n := range []int{0, 1, 15, 16, 17, 1000 + rng.IntN(100), 400_000 + rng.IntN(1000)} {
		x := newTBuf(FP32, n)
		for i := range x.f {
			x.f[i] = randVal(rng, -30, 30)
		}
		var ref float64
		for _, v := range x.f {
			ref += float64(v) * float64(v)
		}
		for _, procs := range []int{1, 2, 3, 7} {
			runtime.GOMAXPROCS(procs)
			got := sumSquaresHost(x.ptr(), n)
			if math.Abs(got-ref) > 1e-12*float64(n)*ref {
				t.Errorf("n %d procs %d: %g, float64 reference %g", n, procs, got, ref)
			}
			// exactly the documented order: parts in order, lanes within a part
			var sums [maxParts]float64
			parts := parallelParts(n, func(k, lo, hi int) { sums[k] = refSumSqLanes(x.f[lo:hi]) })
			var want float64
			for k := 0; k < parts; k++ {
				want += sums[k]
			}
			if got != want {
				t.Errorf("n %d procs %d: %v, not the documented order's %v", n, procs, got, want)
			}
			if again := sumSquaresHost(x.ptr(), n); again != got {
				t.Errorf("n %d procs %d: not deterministic: %v then %v", n, procs, got, again)
			}
		}
		if n > 20 {
			lo, hi := 3+rng.IntN(10), n-rng.IntN(10)
			if got, want := sumSquaresRange(x.ptr(), int64(lo), int64(hi)), refSumSqLanes(x.f[lo:hi]); got != want {
				t.Errorf("range [%d,%d): %v, want %v", lo, hi, got, want)
			}
		}
	}
	inf := newTBuf(FP32, 10)
	inf.f[3] = float32(math.Inf(-1))
	if s := sumSquaresHost(inf.ptr(), 10); !math.IsInf(s, 1) {
		t.Errorf("sum of squares with -inf: %v", s)
	}
}

// ---- reductions across ranks ---------------------------------------------------

var allOps = []ReduceOp{OpSum, OpAvg, OpMax}

// refReduce is op over xs in rank order, in fp32, as the kernels document.
func refReduce(op ReduceOp, xs []float32) float32 {
	s := xs[0]
	for _, x := range xs[1:] {
		if op == OpMax {
			s = refMax(s, x)
		} else {
			s = float32(s + x)
		}
	}
	if op == OpAvg {
		s = float32(s / float32(len(xs)))
	}
	return s
}

func ref64(op ReduceOp, xs []float32) (float64, float64) {
	var s, mag float64
	if op == OpMax {
		s = math.Inf(-1)
		for _, x := range xs {
			s = math.Max(s, float64(x))
		}
		return s, math.Abs(s)
	}
	for _, x := range xs {
		s += float64(x)
		mag += math.Abs(float64(x))
	}
	if op == OpAvg {
		s /= float64(len(xs))
		mag /= float64(len(xs))
	}
	return s, mag
}

func checkReduced(t *testing.T, name string, got *tbuf, bufs []*tbuf, op ReduceOp, i int) bool {
	t.Helper()
	xs := make([]float32, len(bufs))
	for r, b := range bufs {
		xs[r] = b.val(i)
	}
	s := refReduce(op, xs)
	want := refEncode(got.dt, s)
	if !sameBits(got.dt, got.bits(i), want) {
		t.Errorf("%s: element %d: inputs %v -> %#x (%g), want %#x (%g)", name, i, xs, got.bits(i), got.val(i), want, refDecode(got.dt, want))
		return false
	}
	if w64, mag := ref64(op, xs); s == s && !math.IsInf(float64(s), 0) && !math.IsInf(w64, 0) && w64 == w64 {
		rel := float64(len(xs))*math.Ldexp(1, -24) + epsOf(got.dt)
		if !near(got.val(i), w64, mag, rel, tinyOf(got.dt)+tinyOf(FP32)) {
			t.Errorf("%s: element %d: %g, float64 reference %g", name, i, got.val(i), w64)
			return false
		}
	}
	return true
}

func TestReduce(t *testing.T) { forEachLevel(t, testReduce) }

func testReduce(t *testing.T) {
	rng := testRNG(t)
	for _, dt := range allDTypes {
		for _, op := range allOps {
			for n := 1; n <= 8; n++ {
				if !fullSize() && n%3 != 2 && n != 1 {
					continue // n = 1, 2, 5, 8 below the best level
				}
				size := 2*4096 + 1 + rng.IntN(3000) // crosses chunk boundaries
				lo := rng.IntN(70)
				hi := size - rng.IntN(70)
				name := fmt.Sprintf("%v/%v/n=%d/[%d,%d)", dt, op, n, lo, hi)
				srcs := make([]*tbuf, n)
				ptrs := make([]uintptr, n)
				for r := range srcs {
					srcs[r] = newTBuf(dt, size)
					fillRand(rng, srcs[r], rng.IntN(3) == 0)
					ptrs[r] = srcs[r].ptr()
				}
				orig := make([]*tbuf, n)
				for r := range srcs {
					orig[r] = srcs[r].clone()
				}
				// separate destination
				dst := newTBuf(dt, size)
				for i := range size {
					dst.set(i, sentinel)
				}
				reduceHost(dst.ptr(), ptrs, dt, op, lo, hi)
				bad := 0
				for i := 0; i < size && bad < 10; i++ {
					if i < lo || i >= hi {
						if dst.bits(i) != refEncode(dst.dt, sentinel) {
							bad++
							t.Errorf("%s: element %d outside the range was written", name, i)
						}
					} else if !checkReduced(t, name, dst, orig, op, i) {
						bad++
					}
				}
				// in place: the destination is one of the sources
				k := rng.IntN(n)
				reduceHost(ptrs[k], ptrs, dt, op, lo, hi)
				for i := 0; i < size && bad < 10; i++ {
					if i < lo || i >= hi {
						if srcs[k].bits(i) != orig[k].bits(i) {
							bad++
							t.Errorf("%s in place: element %d outside the range was written", name, i)
						}
					} else if srcs[k].bits(i) != dst.bits(i) {
						bad++
						t.Errorf("%s in place into rank %d: element %d: %#x, out of place %#x", name, k, i, srcs[k].bits(i), dst.bits(i))
					}
				}
			}
		}
	}
}

func TestAllReduceFused(t *testing.T) { forEachLevel(t, testAllReduceFused) }

func testAllReduceFused(t *testing.T) {
	rng := testRNG(t)
	for _, dt := range allDTypes {
		for _, op := range allOps {
			for n := 1; n <= 8; n++ {
				if !fullSize() && n%3 != 2 && n != 1 {
					continue // n = 1, 2, 5, 8 below the best level
				}
				size := 4096 + 1 + rng.IntN(9000)
				lo := rng.IntN(100)
				hi := size - rng.IntN(100)
				name := fmt.Sprintf("%v/%v/n=%d/[%d,%d)", dt, op, n, lo, hi)
				bufs := make([]*tbuf, n)
				orig := make([]*tbuf, n)
				ptrs := make([]uintptr, n)
				for r := range bufs {
					bufs[r] = newTBuf(dt, size)
					fillRand(rng, bufs[r], rng.IntN(3) == 0)
					orig[r] = bufs[r].clone()
					ptrs[r] = bufs[r].ptr()
				}
				// in two pieces, as ranks of the in-process group would
				mid := lo + rng.IntN(hi-lo+1)
				allReduceFusedHost(ptrs, dt, op, lo, mid)
				allReduceFusedHost(ptrs, dt, op, mid, hi)
				bad := 0
				for i := 0; i < size && bad < 10; i++ {
					for r := 0; r < n && bad < 10; r++ {
						switch {
						case i < lo || i >= hi:
							if bufs[r].bits(i) != orig[r].bits(i) {
								bad++
								t.Errorf("%s: rank %d element %d outside the range was written", name, r, i)
							}
						case r == 0:
							if !checkReduced(t, name, bufs[0], orig, op, i) {
								bad++
							}
						case bufs[r].bits(i) != bufs[0].bits(i):
							bad++
							t.Errorf("%s: rank %d element %d: %#x, rank 0 has %#x", name, r, i, bufs[r].bits(i), bufs[0].bits(i))
						}
					}
				}
			}
		}
	}
}

// NaN and inf propagate through every op, from any rank.
func TestReduceNonFinite(t *testing.T) { forEachLevel(t, testReduceNonFinite) }

func testReduceNonFinite(t *testing.T) {
	for _, dt := range allDTypes {
		for _, op := range allOps {
			const n = 4
			size := 100
			bufs := make([]*tbuf, n)
			ptrs := make([]uintptr, n)
			for r := range bufs {
				bufs[r] = newTBuf(dt, size)
				for i := range size {
					bufs[r].set(i, float32(r+1))
				}
				ptrs[r] = bufs[r].ptr()
			}
			for i := 0; i < size; i++ {
				r := i % n
				switch i % 3 {
				case 0:
					bufs[r].set(i, float32(math.NaN()))
				case 1:
					bufs[r].set(i, float32(math.Inf(1)))
				}
			}
			dst := newTBuf(dt, size)
			reduceHost(dst.ptr(), ptrs, dt, op, 0, size)
			for i := 0; i < size; i++ {
				got := dst.val(i)
				switch i % 3 {
				case 0:
					if got == got {
						t.Errorf("%v/%v: element %d: NaN from rank %d was lost: %g", dt, op, i, i%n, got)
					}
				case 1:
					if !math.IsInf(float64(got), 1) {
						t.Errorf("%v/%v: element %d: +inf from rank %d was lost: %g", dt, op, i, i%n, got)
					}
				default:
					want := map[ReduceOp]float32{OpSum: 10, OpAvg: 2.5, OpMax: 4}[op]
					if got != want {
						t.Errorf("%v/%v: element %d: %g, want %g", dt, op, i, got, want)
					}
				}
			}
		}
	}
}

// TestSameDTypeIsBitCopy: flatten and cast between equal dtypes with no
// scale copy bits, a signalling NaN included (elementwise.h, zero_copy_elem);
// with a scale, a NaN comes out quiet.
func TestSameDTypeIsBitCopy(t *testing.T) {
	rng := testRNG(t)
	const n = 3000
	for _, d := range []DType{FP32, BF16, FP16} {
		src := make([]byte, n*d.Size())
		for i := range src {
			src[i] = byte(rng.Uint32())
		}
		// a signalling NaN at element 7
		if d == FP32 {
			binary.LittleEndian.PutUint32(src[28:], 0x7f800001)
		} else if d == BF16 {
			binary.LittleEndian.PutUint16(src[14:], 0x7f81)
		} else {
			binary.LittleEndian.PutUint16(src[14:], 0x7c01)
		}
		flat := make([]byte, (n+64)*d.Size())
		segs := []segment{{ptr: uintptr(unsafe.Pointer(&src[0])), count: n, offset: 64}}
		flattenHost(uintptr(unsafe.Pointer(&flat[0])), d, segs, d, 1)
		if !bytes.Equal(flat[64*d.Size():], src) {
			t.Errorf("%v: unscaled flatten is not a bit copy", d)
		}
		cast := make([]byte, len(src))
		castHost(uintptr(unsafe.Pointer(&cast[0])), d, uintptr(unsafe.Pointer(&src[0])), d, n, 1)
		if !bytes.Equal(cast, src) {
			t.Errorf("%v: unscaled cast is not a bit copy", d)
		}
		castHost(uintptr(unsafe.Pointer(&cast[0])), d, uintptr(unsafe.Pointer(&src[0])), d, n, 0.5)
		quiet := uint32(binary.LittleEndian.Uint16(cast[14:])) & 0x0040
		if d == FP16 {
			quiet = uint32(binary.LittleEndian.Uint16(cast[14:])) & 0x0200
		} else if d == FP32 {
			quiet = binary.LittleEndian.Uint32(cast[28:]) & 0x00400000
		}
		if quiet == 0 {
			t.Errorf("%v: a scaled signalling NaN is still signalling", d)
		}
		runtime.KeepAlive(src)
	}
}

// TestKernelTuningChangesNoBits: prefetch, the reductions' chunk and
// non-temporal copies change how memory moves, never a bit of the result:
// reduce and the fused all-reduce over 8 buffers, and a bit-copy flatten
// large enough to stream, under the Intel and AMD choices and an odd chunk.
func TestKernelTuningChangesNoBits(t *testing.T) {
	withoutRace(t)
	rng := testRNG(t)
	defer setKernelTuning(nil)
	const ranks, n = 8, 1_200_001 // bf16 halves of 1.2 MB each: past the streaming threshold
	type result struct{ reduced, fused, flat []byte }
	run := func(tune kernelTuning, in [][]byte, dt DType) result {
		setKernelTuning(&tune)
		var out result
		bufs := make([]uintptr, ranks)
		copies := make([][]byte, ranks)
		for r := range ranks {
			copies[r] = append([]byte(nil), in[r]...)
			bufs[r] = uintptr(unsafe.Pointer(&copies[r][0]))
		}
		out.reduced = make([]byte, n*dt.Size())
		reduceHost(uintptr(unsafe.Pointer(&out.reduced[0])), bufs, dt, OpAvg, 0, n)
		allReduceFusedHost(bufs, dt, OpSum, 0, n)
		out.fused = copies[3]
		out.flat = make([]byte, n*dt.Size())
		flattenHost(uintptr(unsafe.Pointer(&out.flat[0])), dt, []segment{{ptr: bufs[5], count: n}}, dt, 1)
		runtime.KeepAlive(copies)
		return out
	}
	for _, dt := range []DType{FP32, BF16} {
		in := make([][]byte, ranks)
		for r := range in {
			in[r] = make([]byte, n*dt.Size())
			for i := range in[r] {
				in[r][i] = byte(rng.Uint32())
			}
		}
		want := run(kernelTuning{prefetch: true, chunk: 256}, in, dt)
		for _, tune := range []kernelTuning{{chunk: 128, ntCopy: true}, {prefetch: true, chunk: 48, ntCopy: true}} {
			got := run(tune, in, dt)
			for name, pair := range map[string][2][]byte{"reduce": {got.reduced, want.reduced}, "fused all-reduce": {got.fused, want.fused}, "flatten": {got.flat, want.flat}} {
				if !bytes.Equal(pair[0], pair[1]) {
					t.Errorf("%v %s with %+v: bits differ from prefetch on, chunk 256, memcpy", dt, name, tune)
				}
			}
		}
	}
}
