package zero

import (
	"math"
	"math/rand"
	"sort"
	"testing"
)

// The float64 references that several test files check against: the 16-bit
// formats by formula, the bit comparison of a result with its reference,
// unit roundoffs, the optimizer step, the mean of a runSpec's gradients, and
// the quadratic training task.

// ---- the 16-bit formats ------------------------------------------------------

// refDecodeBF16 is the value of bf16 bits, by formula: 1 sign, 8 exponent and
// 7 mantissa bits, bias 127.
func refDecodeBF16(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	e, m := int(h>>7)&0xff, float64(h&0x7f)
	switch e {
	case 0:
		return math.Copysign(math.Ldexp(m, -133), sign)
	case 0xff:
		if m == 0 {
			return math.Inf(int(sign))
		}
		return math.NaN()
	}
	return sign * math.Ldexp(1+m/128, e-127)
}

// refDecodeFP16 is the value of IEEE binary16 bits: 1 sign, 5 exponent and 10
// mantissa bits, bias 15.
func refDecodeFP16(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	e, m := int(h>>10)&0x1f, float64(h&0x3ff)
	switch e {
	case 0:
		return math.Copysign(math.Ldexp(m, -24), sign)
	case 0x1f:
		if m == 0 {
			return math.Inf(int(sign))
		}
		return math.NaN()
	}
	return sign * math.Ldexp(1+m/1024, e-15)
}

// refTable holds the values of the non-negative finite bit patterns of a
// 16-bit format, in order (value order is pattern order), followed by the
// pattern of +inf with the value that the next step would have had with an
// unbounded exponent: rounding to it means overflow to inf.
type refTable struct {
	vals []float64
}

func newRefTable(decode func(uint16) float64, inf uint16, beyond float64) *refTable {
	t := &refTable{vals: make([]float64, int(inf)+1)}
	for h := 0; h < int(inf); h++ {
		t.vals[h] = decode(uint16(h))
	}
	t.vals[inf] = beyond
	return t
}

var (
	refBF16Table = newRefTable(refDecodeBF16, 0x7f80, math.Ldexp(1, 128))
	refFP16Table = newRefTable(refDecodeFP16, 0x7c00, 65536)
)

// round returns the pattern nearest to |x| (ties to the even pattern).
func (t *refTable) round(ax float64) uint16 {
	top := len(t.vals) - 1
	if ax >= t.vals[top] {
		return uint16(top)
	}
	// k: the last pattern with value <= ax
	k := sort.Search(len(t.vals), func(i int) bool { return t.vals[i] > ax }) - 1
	if t.vals[k] == ax {
		return uint16(k)
	}
	below, above := ax-t.vals[k], t.vals[k+1]-ax
	switch {
	case below < above:
		return uint16(k)
	case above < below:
		return uint16(k + 1)
	case k%2 == 0:
		return uint16(k)
	}
	return uint16(k + 1)
}

// refToBF16 rounds a float32 to bf16; a NaN becomes the quiet NaN with the
// same sign and the top payload bits (elementwise.h's documented rule).
func refToBF16(f float32) uint16 {
	u := math.Float32bits(f)
	if f != f {
		return uint16(u>>16) | 0x0040
	}
	h := refBF16Table.round(math.Abs(float64(f)))
	return h | uint16(u>>16)&0x8000
}

// refToFP16 rounds a float32 to fp16; a NaN becomes sign | 0x7e00 | the top 9
// payload bits.
func refToFP16(f float32) uint16 {
	u := math.Float32bits(f)
	sign := uint16(u>>16) & 0x8000
	if f != f {
		return sign | 0x7e00 | uint16(u>>13)&0x1ff
	}
	return sign | refFP16Table.round(math.Abs(float64(f)))
}

// refFromBF16 widens bf16 bits to fp32 bits (a NaN keeps its bits).
func refFromBF16(h uint16) uint32 {
	if v := refDecodeBF16(h); v == v {
		return math.Float32bits(float32(v))
	}
	return uint32(h) << 16
}

// refFromFP16 widens fp16 bits to fp32 bits (a NaN is quietened, payload kept).
func refFromFP16(h uint16) uint32 {
	if v := refDecodeFP16(h); v == v {
		return math.Float32bits(float32(v))
	}
	return uint32(h&0x8000)<<16 | 0x7fc00000 | uint32(h&0x3ff)<<13
}

func refEncode(dt DType, v float32) uint32 {
	switch dt {
	case BF16:
		return uint32(refToBF16(v))
	case FP16:
		return uint32(refToFP16(v))
	}
	return math.Float32bits(v)
}

// refEncodeBits is x's bits in dtype d.
func refEncodeBits(d DType, x float32) uint32 {
	if d == FP32 {
		return math.Float32bits(x)
	}
	return uint32(refEncode(d, x))
}

// refWiden caches refFromBF16 and refFromFP16 for every pattern.
var refWiden = func() (w [2][65536]uint32) {
	for h := range 65536 {
		w[0][h] = refFromBF16(uint16(h))
		w[1][h] = refFromFP16(uint16(h))
	}
	return w
}()

func refDecode(dt DType, bits uint32) float32 {
	switch dt {
	case BF16:
		return math.Float32frombits(refWiden[0][uint16(bits)])
	case FP16:
		return math.Float32frombits(refWiden[1][uint16(bits)])
	}
	return math.Float32frombits(bits)
}

func isNaNBits(dt DType, bits uint32) bool {
	switch dt {
	case BF16:
		return bits&0x7fff > 0x7f80
	case FP16:
		return bits&0x7fff > 0x7c00
	}
	return bits&0x7fffffff > 0x7f800000
}

// sameBits: equal bits, or both NaN (the payload of a NaN that went through
// arithmetic is not part of the contract).
func sameBits(dt DType, got, want uint32) bool {
	if isNaNBits(dt, want) {
		return isNaNBits(dt, got)
	}
	return got == want
}

// unitRoundoff is half the gap between 1 and the next value of d.
func unitRoundoff(d DType) float64 {
	switch d {
	case BF16:
		return math.Ldexp(1, -8)
	case FP16:
		return math.Ldexp(1, -11)
	}
	return math.Ldexp(1, -24)
}

// ---- the optimizer -----------------------------------------------------------

// refAdamW is torch.optim.AdamW in float64, on one element.
type refAdamW struct {
	lr, b1, b2, eps, wd float64
}

func (o refAdamW) step(p, m, v *float64, g float64, t int) (update float64) {
	*p *= 1 - o.lr*o.wd
	*m += (1 - o.b1) * (g - *m)
	*v = *v*o.b2 + (1-o.b2)*g*g
	bc1, bc2 := 1-math.Pow(o.b1, float64(t)), 1-math.Pow(o.b2, float64(t))
	u := (*m / bc1) / (math.Sqrt(*v/bc2) + o.eps)
	*p -= o.lr * u
	return u
}

// refOptStep is one step of AdamW or SGD on one element in float64, from the
// same fp32 state, with the settings of range r (PyTorch's formulas).
func refOptStep(adam bool, r optRange, p, m, v, vmax, g float64) (float64, float64, float64, float64) {
	if adam {
		p *= float64(r.decay)
		m += float64(r.beta1c) * (g - m)
		v = v*float64(r.beta2) + float64(r.beta2c)*g*g
		d := v
		if r.flags&optAMSGrad != 0 {
			vmax = max(vmax, v)
			d = vmax
		}
		p -= float64(r.step) * (m / (math.Sqrt(d)/float64(r.bc2sqrt) + float64(r.eps)))
		return p, m, v, vmax
	}
	g += float64(r.decay) * p
	if r.beta1c != 0 {
		if r.flags&optFirst != 0 {
			m = g
		} else {
			m = m*float64(r.beta1c) + float64(r.beta2)*g
		}
		if r.flags&optNesterov != 0 {
			g += float64(r.beta1c) * m
		} else {
			g = m
		}
	}
	return p - float64(r.step)*g, m, v, vmax
}

// ---- the mean gradient -------------------------------------------------------

// checkMean compares every rank's shard and full gradient against the
// float64 mean (1/(W·G)) Σ_ranks Σ_backwards grad. The bound counts the
// roundings on the way: the cast to the wire dtype, the rank sum, the
// scales and the fp32 accumulation, each relative to Σ|grad|/(W·G).
func checkMean(t *testing.T, r runSpec, params []Param, data workload, res []rankResult) {
	t.Helper()
	g := r.backwards
	if r.reduction == Sum {
		g = 1
	}
	comm := r.comm
	if comm == 0 {
		comm = r.dtype
	}
	rtol := float64(r.world+r.backwards+6) * (unitRoundoff(comm) + unitRoundoff(FP32))
	if r.shard != 0 && r.shard != FP32 {
		// a 16-bit shard rounds each landing: one per backward at most
		rtol += float64(r.backwards+1) * unitRoundoff(r.shard)
	}
	atol := 0.0
	if comm == FP16 {
		atol = float64(r.world+r.backwards) * math.Ldexp(1, -24) / r.predivide
	}
	if r.shard == FP16 { // the shard's subnormals
		atol += float64(r.backwards+1) * math.Ldexp(1, -24)
	}
	for step := range r.steps {
		mean := make([][]float64, len(params))
		mag := make([][]float64, len(params))
		for p, q := range params {
			mean[p] = make([]float64, q.Count)
			mag[p] = make([]float64, q.Count)
			for k := range r.backwards {
				for rank := range r.world {
					for i, v := range data[step][k][rank][p].ref {
						mean[p][i] += v
						mag[p][i] += math.Abs(v)
					}
				}
			}
			div := float64(r.world * g)
			if r.reduction == Sum {
				div = 1
			}
			for i := range mean[p] {
				mean[p][i] /= div
				mag[p][i] /= div
			}
		}
		for rank, rr := range res {
			for p := range params {
				for i, got := range rr.full[step][p] {
					if d := math.Abs(float64(got) - mean[p][i]); !(d <= rtol*mag[p][i]+atol) {
						t.Fatalf("%v: step %d rank %d: full grad of param %d[%d] = %g, want %g (|diff| %g > %g)", r, step, rank, p, i, got, mean[p][i], d, rtol*mag[p][i]+atol)
					}
				}
			}
			// The shard is the rank's slice of every bucket; padding is zero.
			plan := rr.plan
			for b, bp := range plan.Buckets {
				for j := range bp.Shard {
					flat := rank*bp.Shard + j
					got := rr.shard[step][bp.ShardOffset+j]
					p, i := paramAt(plan, params, b, flat)
					if p < 0 {
						if got != 0 {
							t.Fatalf("%v: rank %d bucket %d: padding element %d = %g, want 0", r, rank, b, flat, got)
						}
						continue
					}
					if got != rr.full[step][p][i] && !(math.IsNaN(float64(got)) && math.IsNaN(float64(rr.full[step][p][i]))) {
						t.Fatalf("%v: rank %d: shard element %d of bucket %d = %g, the gathered gradient has %g", r, rank, j, b, got, rr.full[step][p][i])
					}
				}
			}
		}
	}
}

// ---- the quadratic task ------------------------------------------------------

// quadTask is a synthetic regression: sample s of a step has weights a and
// targets t over every element of the model, and loss
// ½ Σ_i a_i (θ_i − t_i)²; its gradient is a_i (θ_i − t_i). The targets lie
// 2-3 away from the start on one side, further than 20 steps of AdamW can
// move (|update| ≤ LR per step in the sign regime), so every sample's
// gradient keeps its sign: the regime in which the error bound of
// TestTrainingEquivalence (optim_test.go) holds.
type quadTask struct {
	sizes   []int
	theta0  []float64
	a, t    [][][]float64 // [step][sample][element]
	samples int           // per step: W·G
}

func newQuadTask(rng *rand.Rand, sizes []int, steps, samples int) *quadTask {
	n := 0
	for _, s := range sizes {
		n += s
	}
	q := &quadTask{sizes: sizes, theta0: make([]float64, n), samples: samples}
	side := make([]float64, n)
	for i := range q.theta0 {
		q.theta0[i] = rng.Float64()*2 - 1
		side[i] = float64(1 - 2*rng.Intn(2))
	}
	q.a, q.t = make([][][]float64, steps), make([][][]float64, steps)
	for st := range steps {
		q.a[st], q.t[st] = make([][]float64, samples), make([][]float64, samples)
		for s := range samples {
			q.a[st][s], q.t[st][s] = make([]float64, n), make([]float64, n)
			for i := range n {
				q.a[st][s][i] = 0.5 + rng.Float64()
				q.t[st][s][i] = q.theta0[i] + side[i]*(2+rng.Float64())
			}
		}
	}
	return q
}

// roundTo makes the start values ones that dtype d holds.
func (q *quadTask) roundTo(d DType) {
	for i, x := range q.theta0 {
		q.theta0[i] = float64(refDecode(d, refEncode(d, float32(x))))
	}
}

// loss is the mean loss of step st's samples at θ, in float64.
func (q *quadTask) loss(st int, theta []float64) float64 {
	l := 0.0
	for s := range q.samples {
		for i, x := range theta {
			d := x - q.t[st][s][i]
			l += 0.5 * q.a[st][s][i] * d * d
		}
	}
	return l / float64(q.samples)
}

// refSumSqLanes repeats zero_sumsq's documented order exactly: element lo+i in
// lane i%16, float64 lanes, tree reduction of the lanes.
func refSumSqLanes(x []float32) float64 {
	var s [16]float64
	for i, v := range x {
		d := float64(v)
		s[i%16] = s[i%16] + float64(d*d)
	}
	for w := 8; w > 0; w /= 2 {
		for k := 0; k < w; k++ {
			s[k] = s[k] + s[k+w]
		}
	}
	return s[0]
}

// neumaier sums xs in float64 with Neumaier's compensation: for
// nonnegative terms within a few units in the last place of the exact sum,
// a reference far tighter than the kernels' bound.
func neumaier(xs []float64) float64 {
	var sum, c float64
	for _, x := range xs {
		t := sum + x
		if math.Abs(sum) >= math.Abs(x) {
			c += (sum - t) + x
		} else {
			c += (x - t) + sum
		}
		sum = t
	}
	return sum + c
}

// ---- the loss scaler ----------------------------------------------------------

// dsScaler is DeepSpeed 0.19.8's DynamicLossScaler (deepspeed/runtime/fp16/
// loss_scaler.py at edaa7221, consecutive_hysteresis false), transcribed
// from its update_scale apart from zero's scaler: the reference the fp16
// tests hold the engine to. (At its minimum with the hysteresis spent,
// DeepSpeed raises instead of halving; no sequence here gets there.)
type dsScaler struct {
	curScale                  float64
	scaleWindow, delayedShift int
	curHysteresis             int
	minScale                  float64
	curIter, lastOverflowIter int
}

func newDSScaler(initScale float64, window, delayedShift int, minScale float64) *dsScaler {
	return &dsScaler{curScale: initScale, scaleWindow: window, delayedShift: delayedShift, curHysteresis: delayedShift,
		minScale: minScale, lastOverflowIter: -1}
}

func (s *dsScaler) updateScale(overflow bool) {
	if overflow {
		if s.delayedShift == 1 || s.curHysteresis == 1 {
			s.curScale = math.Max(s.curScale/2, s.minScale)
		} else {
			s.curHysteresis--
		}
		s.lastOverflowIter = s.curIter
	} else {
		stableInterval := s.curIter - s.lastOverflowIter - 1
		if stableInterval > 0 && stableInterval%s.scaleWindow == 0 {
			s.curHysteresis = s.delayedShift
			s.curScale *= 2
		}
	}
	s.curIter++
}
