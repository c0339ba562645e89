package deepspeed

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// nearest is the reference rounding: among the finite values a 16-bit
// format can hold (sorted, with their codes), the nearest to x, a tie
// going to the even code; beyond the largest by half an ulp or more,
// infinity.
func nearest(x float64, vals []float64, codes []uint16, inf uint16) uint16 {
	sign := uint16(0)
	if math.Signbit(x) {
		sign, x = 0x8000, -x
	}
	i := sort.SearchFloat64s(vals, x)
	if i == len(vals) {
		top := vals[len(vals)-1]
		ulp := top - vals[len(vals)-2]
		if x >= top+ulp/2 {
			return sign | inf
		}
		return sign | codes[len(codes)-1]
	}
	if vals[i] == x || i == 0 {
		return sign | codes[i]
	}
	lo, hi := vals[i-1], vals[i]
	switch {
	case x-lo < hi-x:
		return sign | codes[i-1]
	case x-lo > hi-x:
		return sign | codes[i]
	case codes[i-1]&1 == 0:
		return sign | codes[i-1]
	}
	return sign | codes[i]
}

// table lists a 16-bit format's non-negative finite values and codes.
func table(decode func(uint16) float32, inf uint16) ([]float64, []uint16) {
	var vals []float64
	var codes []uint16
	for c := uint16(0); c < inf; c++ {
		vals = append(vals, float64(decode(c)))
		codes = append(codes, c)
	}
	return vals, codes
}

// TestRoundTo16 holds the fp32 → fp16/bf16 rounding (how the reader makes
// ZeRO-3's model-dtype parameters) to a reference that searches the
// format's values: every code round-trips, and random values, their
// midpoints and the edges (subnormals, the overflow threshold) round to
// nearest even.
func TestRoundTo16(t *testing.T) {
	seed := uint64(rand.Int64())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	bf := func(c uint16) float32 { return math.Float32frombits(uint32(c) << 16) }
	for _, f := range []struct {
		name   string
		round  func(float32) uint16
		decode func(uint16) float32
		inf    uint16
	}{{"fp16", floatToHalf, halfToFloat, 0x7c00}, {"bf16", floatToBF16, bf, 0x7f80}} {
		vals, codes := table(f.decode, f.inf)
		var xs []float32
		for c := uint16(0); c <= f.inf; c++ {
			xs = append(xs, f.decode(c), -f.decode(c))
			if c > 0 && c < f.inf { // midpoints and their neighbours
				m := float32((float64(f.decode(c-1)) + float64(f.decode(c))) / 2)
				xs = append(xs, m, math.Nextafter32(m, 0), math.Nextafter32(m, 1e30))
			}
		}
		for range 200000 {
			xs = append(xs, math.Float32frombits(rng.Uint32()&0x7f7fffff|rng.Uint32()&0x80000000))
		}
		for _, x := range xs {
			want := nearest(float64(x), vals, codes, f.inf)
			if got := f.round(x); got != want {
				t.Fatalf("%s(%v = %#08x) = %#04x, want %#04x", f.name, x, math.Float32bits(x), got, want)
			}
		}
		if n := f.round(float32(math.NaN())); f.decode(n) == f.decode(n) {
			t.Errorf("%s(NaN) = %#04x, not a NaN", f.name, n)
		}
	}
}

// TestHalfToFloat holds every binary16 code's decoding to its definition:
// (-1)^s · 2^(e-15) · 1.m, or 2^-14 · 0.m for subnormals.
func TestHalfToFloat(t *testing.T) {
	for c := 0; c < 1<<16; c++ {
		s, e, m := c>>15, (c>>10)&0x1f, c&0x3ff
		var want float64
		switch {
		case e == 0x1f && m == 0:
			want = math.Inf(1)
		case e == 0x1f:
			if got := halfToFloat(uint16(c)); got == got {
				t.Fatalf("%#04x is a NaN, decoded %v", c, got)
			}
			continue
		case e == 0:
			want = math.Ldexp(float64(m), -24)
		default:
			want = math.Ldexp(float64(m|0x400), e-25)
		}
		if s == 1 {
			want = -want
		}
		if got := halfToFloat(uint16(c)); float64(got) != want || math.Signbit(float64(got)) != (s == 1) {
			t.Fatalf("%#04x decoded %v, want %v", c, got, want)
		}
	}
}
