package main

// The self-check: zero's run against GoMLX training alone, within bounds
// derived from fp32's unit roundoff u = 2⁻²⁴ and the steps.

import (
	"fmt"
	"math"
)

// at is what the check knows at one set of parameters and one batch:
// GoMLX's own whole-batch loss and gradient (fp32, the graph the reference's
// AdamW steps with) and the float64 oracle.
type at struct {
	loss float64
	grad [][]float32
	o    oracle
}

// evaluateAll evaluates GoMLX and the oracle at params[t] on step t's batch,
// for t = 0..steps−1 (each step's parameters before it).
func evaluateAll(c config, ev *evaluator, params [][][]float32) ([]at, error) {
	out := make([]at, c.steps)
	for st := range c.steps {
		l, g, err := ev.at(params[st], st)
		if err != nil {
			return nil, err
		}
		x, y := c.batchData(st)
		out[st] = at{loss: l, grad: g, o: c.evaluate(params[st], x, y)}
	}
	return out, nil
}

// gradTol bounds how far two fp32 evaluations of the batch's gradient at
// the same parameters can lie apart when they compute every row alike
// (rowsIdentical) and group the batch sum differently: the reference sums B
// per-sample terms in one graph (γ_B), zero sums B/(W·G) in a graph and then
// G and W partial sums (γ_{B/(W·G)+G+W}), each at most γ times the sum of
// the terms' magnitudes, Σ_s |fl(term_s)| / N ≤ abs + rowErr (the oracle's).
func (c config) gradTol(o oracle, p, i int) float64 {
	return (gamma(c.batch) + gamma(c.micro()+c.accum+c.world)) * (o.abs[p][i] + o.rowErr[p][i])
}

// verdict is the check of one run.
type verdict struct {
	failures []string
	// the largest observed difference as a fraction of its bound
	worstGrad, worstGrad64, worstParam1, worstParam, worstLoss float64
	maxDTheta, maxDiff                                         float64   // the largest dθ, and parameter difference, over the run
	lossBound                                                  []float64 // per step
}

func (v *verdict) fail(format string, args ...any) {
	if len(v.failures) < 8 {
		v.failures = append(v.failures, fmt.Sprintf(format, args...))
	}
}

func (v *verdict) within(worst *float64, d, bound float64, format string, args ...any) {
	if !(d <= bound) {
		v.fail(format+": |diff| %.3g > bound %.3g", append(args, d, bound)...)
		return
	}
	if bound > 0 {
		*worst = math.Max(*worst, d/bound)
	}
}

// adamFirst is AdamW's first update direction, m̂/(√v̂ + ε) = g/(|g| + ε).
func adamFirst(g, eps float64) float64 { return g / (math.Abs(g) + eps) }

// checkRun holds a zero run to the reference (GoMLX alone), step by step.
// ref and res hold the parameters before the first step and after each;
// refAt and zAt the evaluations at each step's starting parameters.
//
//   - The gradient (every step): zero's reduced mean gradient, the one its
//     AdamW stepped with, against GoMLX's whole-batch gradient at the same
//     parameters, within gradTol: the two differ only in how the batch sum
//     is grouped. This catches a gradient missing or counted wrongly, which
//     AdamW, whose first steps move each element by about lr whatever the
//     gradient's size, would hide from the parameters. (Also, loosely,
//     against the float64 oracle's exact gradient within its worst-case
//     running error bound: GoMLX's graphs compute the model of model.go.)
//
//   - The parameters after step 1, from the same θ₀: both AdamWs take
//     θ₁ = θ₀·(1 − lr·wd) − lr·f(ĝ), f(g) = g/(|g| + ε) (the first step's
//     bias-corrected moments are g and |g|), each in about ten fp32
//     operations; so |θ₁ᶻ − θ₁ʳ| ≤ lr·|f(ĝ_z) − f(ĝ_r)| + u·(4|θ₀| + 32·lr),
//     with ĝ_r anywhere within gradTol of GoMLX's gradient (the reference's
//     graph may group its sum otherwise). A few ulps of θ.
//
//   - The parameters after every step, within dθ of GoMLX's, carried step
//     by step. The runs step with gradients that differ by at most
//     E = |g_G(θ_z) − g_G(θ_r)| + tol(θ_z) + tol(θ_r) (GoMLX's gradient at
//     both runs' parameters, and each run's grouping of the sum). The
//     moments then differ by at most
//
//     dm ← β1·dm + (1−β1)·E + (roundings), dv ← β2·dv + (1−β2)·E·(2|g| + 2·tol + E) + (roundings)
//
//     (each run's moment update rounds three or four times, ≤ 4u of the
//     terms), and after the bias corrections (GoMLX's in fp32, zero's in
//     float64: 4u more) the update m̂/(√v̂ + ε) by at most
//     dm̂/(s + ε) + |m̂|·|Δ√v̂|/(s + ε)², with s the smallest √v̂ the bounds
//     allow and |Δ√v̂| ≤ min(dv̂/(2s), √dv̂); the moments' own values come
//     from GoMLX's gradients at the reference's parameters, in float64. The
//     triangle inequality caps it at |û_z| + |û_r| (the updates the runs
//     took, read from their parameters). The step's arithmetic adds
//     u·(4|θ| + 32·lr·|û|), and a carried difference shrinks by the decay:
//
//     dθ ← dθ·(1 − lr·wd) + lr·|Δû| + u·(4|θ| + 32·lr·|û|).
//
//   - The loss (every step), at θ_z and θ_r before the step: at the same
//     parameters the two differ only in the grouping of the mean's sum
//     (γ_{B·D} + γ_{B·D/(W·G)+G+W} of the loss, a mean of squares); the
//     parameters' difference adds, to first order, Σ max(|g_z|, |g_r|)·dθ
//     (the gradient at both ends, as the mean value theorem's point lies
//     between them).
func checkRun(c config, ref reference, refAt []at, res run, zAt []at) verdict {
	var v verdict
	if len(res.params) != c.steps+1 || len(res.loss) != c.steps || len(res.grads) != c.steps {
		v.fail("the run recorded %d parameter sets, %d losses and %d gradients for %d steps", len(res.params), len(res.loss), len(res.grads), c.steps)
		return v
	}
	P := c.numParams()
	type elem struct{ dtheta, m, v, dm, dv float64 } // dθ; the moments (float64) and their bounds
	state := make([][]elem, P)
	for p, n := range flatSizes(c) {
		state[p] = make([]elem, n)
	}
	lr, eps, decay := f32(c.lr), f32(c.eps), 1-f32(c.lr)*f32(c.wd)
	b1, b2 := f32(0.9), f32(0.999)
	m := c.micro()
	for st := range c.steps {
		za, ra := zAt[st], refAt[st]
		bc1, bc2 := 1-math.Pow(b1, float64(st+1)), 1-math.Pow(b2, float64(st+1))
		// the loss at the parameters before this step, dθ from the last
		bound := (gamma(c.batch*c.width) + gamma(m*c.width+c.accum+c.world)) * ref.loss[st] * (1 + 1e-3)
		for p := range P {
			for i, e := range state[p] {
				bound += math.Max(math.Abs(float64(za.grad[p][i])), math.Abs(float64(ra.grad[p][i]))) * e.dtheta
			}
		}
		v.lossBound = append(v.lossBound, bound)
		v.within(&v.worstLoss, math.Abs(res.loss[st]-ref.loss[st]), bound, "step %d: loss %.9g, reference %.9g", st+1, res.loss[st], ref.loss[st])
		for p := range P {
			gz := res.grads[st][p]
			thZ0, thZ1 := res.params[st][p], res.params[st+1][p]
			thR0, thR1 := ref.params[st][p], ref.params[st+1][p]
			for i := range gz {
				tz, tr := c.gradTol(za.o, p, i), c.gradTol(ra.o, p, i)
				gG, gR := float64(za.grad[p][i]), float64(ra.grad[p][i])
				// zero's gradient, against GoMLX's at the same parameters
				v.within(&v.worstGrad, math.Abs(float64(gz[i])-gG), tz, "step %d: %s[%d]'s reduced gradient %.9g, GoMLX's %.9g", st+1, paramName(p), i, gz[i], gG)
				v.within(&v.worstGrad64, math.Abs(float64(gz[i])-za.o.grad[p][i]), za.o.err[p][i], "step %d: %s[%d]'s reduced gradient %.9g, exact %.9g", st+1, paramName(p), i, gz[i], za.o.grad[p][i])
				// the parameters
				ur := (float64(thR0[i])*decay - float64(thR1[i])) / lr
				uz := (float64(thZ0[i])*decay - float64(thZ1[i])) / lr
				round := u * (4*math.Abs(float64(thR1[i])) + 32*lr*math.Max(math.Abs(ur), math.Abs(uz)))
				d := math.Abs(float64(thZ1[i]) - float64(thR1[i]))
				if st == 0 {
					f := adamFirst(float64(gz[i]), eps)
					b := lr*math.Max(math.Abs(f-adamFirst(gR-tr, eps)), math.Abs(f-adamFirst(gR+tr, eps))) +
						u*(4*math.Abs(float64(thR0[i]))+32*lr)
					v.within(&v.worstParam1, d, b, "step 1: %s[%d] = %.9g, reference %.9g", paramName(p), i, thZ1[i], thR1[i])
				}
				e := &state[p][i]
				E := math.Abs(gG-gR) + tz + tr
				mPrev, vPrev := e.m, e.v
				e.m = b1*e.m + (1-b1)*gR
				e.v = b2*e.v + (1-b2)*gR*gR
				e.dm = b1*e.dm + (1-b1)*E + 8*u*(b1*math.Abs(mPrev)+(1-b1)*math.Abs(gR)+math.Abs(e.m))
				e.dv = b2*e.dv + (1-b2)*E*(2*(math.Abs(gR)+tr)+E) + 8*u*(b2*vPrev+(1-b2)*gR*gR+e.v)
				mh, dmh := math.Abs(e.m)/bc1, e.dm/bc1+8*u*math.Abs(e.m)/bc1
				vh, dvh := e.v/bc2, e.dv/bc2+8*u*e.v/bc2
				s := math.Sqrt(math.Max(vh-dvh, 0))
				dsq := math.Sqrt(dvh)
				if s > 0 {
					dsq = math.Min(dsq, dvh/(2*s))
				}
				du := dmh/(s+eps) + (mh+dmh)*dsq/((s+eps)*(s+eps))
				du = math.Min(du, math.Abs(uz)+math.Abs(ur))
				e.dtheta = e.dtheta*decay + lr*du + round
				v.within(&v.worstParam, d, e.dtheta, "step %d: %s[%d] = %.9g, reference %.9g", st+1, paramName(p), i, thZ1[i], thR1[i])
				v.maxDTheta = math.Max(v.maxDTheta, e.dtheta)
				v.maxDiff = math.Max(v.maxDiff, d)
			}
		}
	}
	return v
}

func flatSizes(c config) []int {
	out := make([]int, 0, c.numParams())
	for range c.blocks {
		s := c.sizes()
		out = append(out, s[:]...)
	}
	return out
}

func paramName(p int) string { return blockScope(p/4) + "." + paramNames[p%4] }

// checkResume holds a run that saved a checkpoint, started afresh and
// loaded it (resumed) to the same run straight through: nothing of the
// training state may be lost or rounded on the way, and each run is
// deterministic (the same data, the same order of every sum), so every
// recorded value must be equal bit for bit: each step's loss and reduced
// gradient, and the parameters after each step (at stages 1 and 2 read
// from GoMLX's variables, which Load wrote).
func checkResume(straight, resumed run) []string {
	var fails []string
	fail := func(format string, args ...any) {
		if len(fails) < 8 {
			fails = append(fails, fmt.Sprintf(format, args...))
		}
	}
	if len(resumed.params) != len(straight.params) || len(resumed.loss) != len(straight.loss) || len(resumed.grads) != len(straight.grads) {
		fail("the resumed run recorded %d parameter sets and %d losses, the straight one %d and %d",
			len(resumed.params), len(resumed.loss), len(straight.params), len(straight.loss))
		return fails
	}
	same := func(a, b float32) bool { return math.Float32bits(a) == math.Float32bits(b) }
	for st := range straight.loss {
		if math.Float64bits(resumed.loss[st]) != math.Float64bits(straight.loss[st]) {
			fail("step %d: loss %.9g, straight through %.9g", st+1, resumed.loss[st], straight.loss[st])
		}
		for p, g := range straight.grads[st] {
			for i := range g {
				if !same(resumed.grads[st][p][i], g[i]) {
					fail("step %d: %s[%d]'s reduced gradient %.9g, straight through %.9g", st+1, paramName(p), i, resumed.grads[st][p][i], g[i])
					break
				}
			}
		}
	}
	for st := range straight.params {
		for p, th := range straight.params[st] {
			for i := range th {
				if !same(resumed.params[st][p][i], th[i]) {
					fail("after step %d: %s[%d] = %.9g, straight through %.9g", st, paramName(p), i, resumed.params[st][p][i], th[i])
					break
				}
			}
		}
	}
	return fails
}
