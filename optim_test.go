package zero

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"testing"
	"time"
	"unsafe"
)

// ---- training equivalence ---------------------------------------------------

// TestTrainingEquivalence: AdamW training across W ranks, stages 1 and 2,
// fp32 and bf16, 1 and 3 backwards per step, against plain training on the
// same global batch in float64. The bound is carried along the reference
// trajectory, element by element, step by step:
//   - the engine's parameter differs from the reference by dθ (plus one
//     rounding to the model dtype for the copy the forward reads);
//   - each sample's gradient, computed in fp32 from that copy and rounded to
//     the model dtype, differs from the exact one by a·dθ' + 2u32·a(|θ|+|t|)
//   - u_d·|g|, and the reduction adds (W+G+6)(u_d+u32)·mean|g| (the bound of
//     checkMean); with every sample's gradient of one sign, that is a
//     relative error ρ of the mean gradient;
//   - with every gradient of the window carrying a relative error ≤ ρ (plus
//     8u32 per step for the fp32 rounding of the moments), m is within
//     (1±ρ)m and √v within (1±ρ)√v, so the update m̂/(√v̂+ε) is within
//     2ρ/(1−ρ) of its own size;
//   - the step's fp32 arithmetic adds u32(4|θ| + 32·lr·|u|);
//
// so dθ ← dθ(1 − lr·wd) + lr·|u|·2ρ/(1−ρ) + u32(4|θ| + 32·lr·|u|). The final
// parameters must be within dθ plus a rounding to the model dtype, and the
// loss within what that difference can change it by.
func TestTrainingEquivalence(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	sizes := []int{37, 130, 8, 257}
	opt := with(NewAdamW(0.01), func(o *AdamW) { o.WeightDecay = 0.01 })
	ref := refAdamW{lr: 0.01, b1: 0.9, b2: 0.999, eps: 1e-8, wd: 0.01}
	const steps = 20
	const u32 = 0x1p-24
	for _, dt := range []DType{FP32, BF16} {
		ud := unitRoundoff(dt)
		for _, world := range []int{1, 2, 4} {
			for _, backwards := range []int{1, 3} {
				q := newQuadTask(rng, sizes, steps, world*backwards)
				q.roundTo(dt) // start from values the model dtype holds
				// the reference and the bound, element by element
				n := len(q.theta0)
				theta, m, v := slices.Clone(q.theta0), make([]float64, n), make([]float64, n)
				dtheta, rho := make([]float64, n), make([]float64, n)
				refParams := [][]float64{slices.Clone(theta)}
				bounds := [][]float64{make([]float64, n)}
				for st := range steps {
					for i := range n {
						gsum, gabs, esum := 0.0, 0.0, 0.0
						dd := dtheta[i] + ud*(math.Abs(theta[i])+dtheta[i]) // the copy the forward reads
						sign := 0.0
						for s := range q.samples {
							a, tt := q.a[st][s][i], q.t[st][s][i]
							g := a * (theta[i] - tt)
							if sign == 0 {
								sign = math.Copysign(1, g)
							} else if math.Copysign(1, g) != sign {
								t.Fatalf("element %d: sample gradients change sign; the bound needs one sign", i)
							}
							gsum += g
							gabs += math.Abs(g)
							esum += a*dd + 2*u32*a*(math.Abs(theta[i])+dd+math.Abs(tt)) + ud*math.Abs(g)*(1+ud)
						}
						S := float64(q.samples)
						g, e := gsum/S, esum/S+float64(world+backwards+6)*(ud+u32)*gabs/S
						rho[i] = max(rho[i], e/math.Abs(g)) + 8*u32
						if rho[i] >= 0.5 {
							t.Fatalf("element %d: relative gradient error bound %g; the task leaves the regime", i, rho[i])
						}
						u := ref.step(&theta[i], &m[i], &v[i], g, st+1)
						dtheta[i] = dtheta[i]*(1-ref.lr*ref.wd) + ref.lr*math.Abs(u)*2*rho[i]/(1-rho[i]) + u32*(4*math.Abs(theta[i])+32*ref.lr*math.Abs(u))
					}
					refParams = append(refParams, slices.Clone(theta))
					bounds = append(bounds, slices.Clone(dtheta))
				}
				var firstBits [][]uint32
				for _, stage := range []int{1, 2} {
					for v, variant := range []struct {
						bucket  int
						overlap bool
					}{{512, true}, {1 << 20, false}, {512, false}} {
						r := trainRun{stage: stage, world: world, backwards: backwards, dtype: dt, bucket: variant.bucket, overlap: variant.overlap}
						got, final := trainEngine(t, q, r, opt)
						for st := range steps + 1 {
							worstParam, worstLoss := 0.0, 0.0
							dl := 0.0
							for i := range n {
								allowed := bounds[st][i] + ud*(math.Abs(refParams[st][i])+bounds[st][i])
								d := math.Abs(got[st][i] - refParams[st][i])
								if !(d <= allowed) {
									t.Fatalf("%+v step %d: element %d = %.9g, reference %.9g: |diff| %.3g > bound %.3g", r, st, i, got[st][i], refParams[st][i], d, allowed)
								}
								worstParam = max(worstParam, d/max(allowed, 1e-30))
								sq := st
								if sq == steps {
									sq = steps - 1
								}
								for s := range q.samples {
									a := q.a[sq][s][i]
									dl += (a*math.Abs(refParams[st][i]-q.t[sq][s][i])*allowed + 0.5*a*allowed*allowed) / float64(q.samples)
								}
							}
							sq := min(st, steps-1)
							if d := math.Abs(q.loss(sq, got[st]) - q.loss(sq, refParams[st])); !(d <= dl+1e-12*q.loss(sq, refParams[st])) {
								t.Fatalf("%+v step %d: loss %.9g, reference %.9g: |diff| %.3g > bound %.3g", r, st, q.loss(sq, got[st]), q.loss(sq, refParams[st]), d, dl)
							}
							worstLoss = max(worstLoss, dl)
							if st == steps && v == 0 && stage == 1 {
								t.Logf("%v W=%d G=%d: after %d steps the largest difference is %.2f of its bound", dt, world, backwards, steps, worstParam)
							}
						}
						// every rank holds the same parameters, and for this W the
						// bucket size and overlap change no bit
						for rank := range final {
							if !slices.Equal(final[rank], final[0]) {
								t.Fatalf("%+v: rank %d's parameters differ from rank 0's", r, rank)
							}
						}
						if firstBits == nil {
							firstBits = final
						} else if !slices.Equal(final[0], firstBits[0]) {
							t.Fatalf("%+v: parameters differ in their bits from bucket 512 with overlap", r)
						}
					}
					firstBits = nil // ZeRO-1 and ZeRO-2 round the same sums, but not in the same place
				}
			}
		}
	}
}

// ---- the optimizer kernels against float64 ------------------------------------

// TestOptimizerKernels: AdamW (with and without amsgrad) and SGD (plain,
// momentum, Nesterov, weight decay) at every ISA level, five steps with a
// learning-rate schedule, two groups with their own settings over
// interleaved ranges and a gap no range covers, each step against float64
// from the same fp32 state: within a few fp32 roundings of every quantity,
// and the gap untouched.
func TestOptimizerKernels(t *testing.T) { forEachLevel(t, testOptimizerKernels) }

func testOptimizerKernels(t *testing.T) {
	rng := testRNG(t)
	const n = 5000
	const u = 0x1p-24
	groups := []struct {
		adam bool
		opts []Optimizer
	}{
		{true, []Optimizer{with(NewAdamW(1e-3), func(o *AdamW) { o.WeightDecay = 0.01 }), with(NewAdamW(3e-3), func(o *AdamW) { o.Beta1 = 0.8; o.Beta2 = 0.99; o.AMSGrad = true })}},
		{false, []Optimizer{with(NewSGD(0.05), func(o *SGD) { o.Momentum = 0.9; o.WeightDecay = 1e-4 }), with(NewSGD(0.02), func(o *SGD) { o.Momentum = 0.9; o.Nesterov = true })}},
		{false, []Optimizer{NewSGD(0.1), with(NewSGD(0.05), func(o *SGD) { o.Momentum = 0.5; o.Dampening = 0.3 })}},
	}
	for _, gr := range groups {
		p, m, v, vmax, g := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
		out := make([]uint16, n)
		for i := range p {
			p[i] = float32(rng.NormFloat64())
		}
		for step := 1; step <= 5; step++ {
			for i := range g {
				g[i] = float32(rng.NormFloat64() * 0.1)
			}
			var ranges []optRange
			for off, k := 0, 0; off < n-100; k++ { // ranges of varied lengths, alternating groups, a gap at the end
				c := min(1+rng.IntN(700), n-100-off)
				r := optRange{offset: int64(off), count: int64(c)}
				o := gr.opts[k%2]
				switch x := o.(type) { // a schedule: the rate moves every step
				case AdamW:
					x.LR *= 1 + 0.1*float64(step)
					o = x
				case SGD:
					x.LR *= 1 + 0.1*float64(step)
					o = x
				}
				o.rangeFor(&r, step)
				ranges = append(ranges, r)
				off += c
			}
			gscale := float32(0.5)
			p0, m0, v0, x0 := slices.Clone(p), slices.Clone(m), slices.Clone(v), slices.Clone(vmax)
			b := optBuffers{p: sliceAddr(p), g: sliceAddr(g), m: sliceAddr(m), v: sliceAddr(v), vmax: sliceAddr(vmax), buf: sliceAddr(m), out: sliceAddr16(out), outType: BF16}
			if gr.adam {
				adamwHost(b, ranges, gscale, n)
			} else {
				sgdHost(b, ranges, gscale, n)
			}
			for _, r := range ranges {
				for i := r.offset; i < r.offset+r.count; i++ {
					gg := float64(g[i] * gscale)
					wp, wm, wv, wx := refOptStep(gr.adam, r, float64(p0[i]), float64(m0[i]), float64(v0[i]), float64(x0[i]), gg)
					upd := math.Abs(wp - float64(p0[i]))
					tolP := 16 * u * (math.Abs(float64(p0[i])) + upd + float64(r.step)*math.Abs(gg))
					tolM := 8 * u * (math.Abs(float64(m0[i])) + math.Abs(gg) + math.Abs(wm))
					tolV := 8 * u * (float64(v0[i]) + gg*gg)
					if d := math.Abs(float64(p[i]) - wp); !(d <= tolP) {
						t.Fatalf("adam=%v step %d element %d: p = %.9g, float64 %.9g (|diff| %.3g > %.3g)", gr.adam, step, i, p[i], wp, d, tolP)
					}
					if (gr.adam || r.beta1c != 0) && !(math.Abs(float64(m[i])-wm) <= tolM) {
						t.Fatalf("adam=%v step %d element %d: m = %.9g, float64 %.9g", gr.adam, step, i, m[i], wm)
					}
					if gr.adam && !(math.Abs(float64(v[i])-wv) <= tolV) {
						t.Fatalf("step %d element %d: v = %.9g, float64 %.9g", step, i, v[i], wv)
					}
					if gr.adam && r.flags&optAMSGrad != 0 && !(math.Abs(float64(vmax[i])-wx) <= tolV+8*u*wx) {
						t.Fatalf("step %d element %d: vmax = %.9g, float64 %.9g", step, i, vmax[i], wx)
					}
					if out[i] != bf16FromFloat(p[i]) {
						t.Fatalf("adam=%v step %d element %d: the bf16 copy %#x is not bf16(p) %#x", gr.adam, step, i, out[i], bf16FromFloat(p[i]))
					}
				}
			}
			for i := n - 100; i < n; i++ {
				if p[i] != p0[i] || m[i] != m0[i] || v[i] != v0[i] || out[i] != 0 && step == 1 {
					t.Fatalf("adam=%v step %d: element %d, in no range, changed", gr.adam, step, i)
				}
			}
		}
	}
}

func sliceAddr(x []float32) uintptr  { return uintptr(unsafe.Pointer(&x[0])) }
func sliceAddr16(x []uint16) uintptr { return uintptr(unsafe.Pointer(&x[0])) }

// ---- the loss scaler ----------------------------------------------------------

// TestLossScaler: DeepSpeed's dynamic loss scaler, trajectories worked out
// by hand from its rules (window 4, hysteresis 2, min 1, initial 2^16).
func TestLossScaler(t *testing.T) {
	for name, tc := range map[string]struct {
		overflow string // one letter per step: o overflow, . clean
		want     []float64
	}{
		// doubles when the stable interval, iter − last overflow − 1, is a
		// positive multiple of the window, the last overflow at −1 to begin
		// with: after steps 4 and 8
		"clean": {".........", []float64{1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 17, 1 << 17, 1 << 17, 1 << 17, 1 << 18}},
		// the first overflow spends the hysteresis, the next ones halve
		"every step": {"oooo", []float64{1 << 16, 1 << 15, 1 << 14, 1 << 13}},
		// hysteresis is given back when the scale doubles, at the fourth
		// clean step after the overflow at 0 (step 5): the overflow at 6 is
		// absorbed again, the one at 9 halves
		"some": {"o.....o..o", []float64{1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 17, 1 << 17, 1 << 17, 1 << 17, 1 << 16}},
		// only 3 clean steps after the overflow at 0: no doubling, and the
		// overflow at 4 halves; so does the one at 6
		"twice": {"o...o.o.", []float64{1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 15, 1 << 15, 1 << 14, 1 << 14}},
	} {
		c := LossScale{Window: 4}
		if err := c.resolve(FP16); err != nil {
			t.Fatal(err)
		}
		s := newLossScaler(c)
		for i, c := range tc.overflow {
			s.update(c == 'o')
			if s.scale != tc.want[i] {
				t.Fatalf("%s: after step %d (%c) the scale is %v, want %v", name, i, c, s.scale, tc.want[i])
			}
		}
	}
	scaler := func(c LossScale, model DType) (lossScaler, error) {
		err := c.resolve(model)
		return newLossScaler(c), err
	}
	s, _ := scaler(LossScale{Initial: 4, Window: 1000, Hysteresis: 1}, FP16)
	for range 5 {
		s.update(true)
	}
	if s.scale != 1 {
		t.Errorf("the scale fell to %v, below the minimum of 1", s.scale)
	}
	for _, c := range []LossScale{{}, {Initial: 1024, Window: 10}} {
		if s, _ := scaler(c, BF16); s.scale != 1 || s.dynamic {
			t.Errorf("bf16 with %+v: scale %v dynamic %v, want a static 1", c, s.scale, s.dynamic)
		}
	}
	if s, _ := scaler(LossScale{Static: 128}, FP16); s.scale != 128 || s.dynamic {
		t.Errorf("static 128: scale %v dynamic %v", s.scale, s.dynamic)
	}
	for name, c := range map[string]struct {
		ls LossScale
		dt DType
	}{
		"negative static":       {LossScale{Static: -1}, FP16},
		"static and dynamic":    {LossScale{Static: 8, Window: 10}, FP16},
		"min above the initial": {LossScale{Initial: 4, Min: 8}, FP16},
		"infinite initial":      {LossScale{Initial: math.Inf(1)}, FP16},
	} {
		if _, err := scaler(c.ls, c.dt); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", name, err)
		}
	}
}

// TestSkippedStepChangesNothing: an overflow on one rank makes every rank
// skip; master weights, moments, step counts and parameters are bit for bit
// as they were, the loss scale moves the same on every rank, and the window
// is consumed: the next window steps normally.
func TestSkippedStepChangesNothing(t *testing.T) {
	for _, stage := range []int{1, 2} {
		for _, dt := range []DType{FP16, BF16} {
			comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
			errs := eachRank(2, func(rank int) error {
				ps, bufs := smallModel(dt, 0.5)
				e, err := New(Config{Stage: stage, BucketBytes: 512, Precision: PrecisionPolicy{LossScale: LossScale{Initial: 256, Hysteresis: 1}}, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.01)}}}, comms[rank], ps)
				if err != nil {
					return err
				}
				defer e.Close()
				s := NewHostStream()
				defer s.Close()
				report := func(bad bool) error {
					for p := 2; p >= 0; p-- {
						g := newTBuf(dt, ps[p].Count)
						for i := range g.len() {
							g.set(i, 0.25)
						}
						if bad && rank == 1 && p == 2 {
							g.set(17, float32(math.Inf(1)))
						}
						if _, err := e.GradReady(p, g.t(), s); err != nil {
							return err
						}
					}
					return e.EndBackward()
				}
				if err := report(false); err != nil { // a normal step first, so there is state
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				before := snapshotState(e, bufs)
				if err := report(true); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				st := e.Stats()
				if !st.Skipped {
					return fmt.Errorf("rank %d: a step with an inf gradient on rank 1 was not skipped", rank)
				}
				after := snapshotState(e, bufs)
				if !before.equal(after) {
					return fmt.Errorf("rank %d: the skipped step changed the master, moments, steps or parameters", rank)
				}
				wantScale := before.scale // bf16: no scaler
				if dt == FP16 {
					wantScale = before.scale / 2 // hysteresis 1: every overflow halves
				}
				if after.scale != wantScale {
					return fmt.Errorf("rank %d: loss scale %v after the skip, want %v", rank, after.scale, wantScale)
				}
				if err := report(false); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				if e.Stats().Skipped || snapshotState(e, bufs).equal(after) {
					return fmt.Errorf("rank %d: the window after the skip did not step", rank)
				}
				return nil
			})
			everyRankIs(t, fmt.Sprintf("stage %d %v", stage, dt), errs, nil)
		}
	}
}

// TestClipping: with SGD the update is linear in the gradient, so the
// clipped step is known exactly: the mean gradient (over 2 ranks and 3
// backwards) times 1/max(1, norm/clip), the norm over every element; a
// non-finite norm skips the step.
func TestClipping(t *testing.T) {
	for _, clip := range []float64{0, 0.5, 1e6} {
		comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
		var norms [2]float64
		errs := eachRank(2, func(rank int) error {
			ps, bufs := smallModel(FP32, 0)
			e, err := New(Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Clip: clip, Groups: []Optimizer{NewSGD(0.5)}}}, comms[rank], ps)
			if err != nil {
				return err
			}
			defer e.Close()
			s := NewHostStream()
			defer s.Close()
			before := snapshotState(e, bufs)
			// gradient of element j of parameter p in backward k on rank r:
			// 0.01·(1 + j%5)·(k+1)·(r+1); mean over 6 = 0.01·(1+j%5)·2·1.5
			exact := func(p, j int) float64 { return 0.01 * float64(1+j%5) * 2 * 1.5 }
			sumsq := 0.0
			for k := range 3 {
				for p := 2; p >= 0; p-- {
					g := make([]float32, ps[p].Count)
					for j := range g {
						g[j] = float32(0.01 * float64(1+j%5) * float64(k+1) * float64(rank+1))
						if k == 0 {
							sumsq += exact(p, j) * exact(p, j)
						}
					}
					if _, err := e.GradReady(p, Float32s(g), s); err != nil {
						return err
					}
				}
				if err := e.EndBackward(); err != nil {
					return err
				}
			}
			if err := e.Step(); err != nil {
				return err
			}
			norms[rank] = e.Stats().GradNorm
			if math.Abs(norms[rank]-math.Sqrt(sumsq)) > 1e-5*math.Sqrt(sumsq) {
				return fmt.Errorf("norm %v, want %v", norms[rank], math.Sqrt(sumsq))
			}
			coef := 1.0
			if clip > 0 {
				coef = max(1, math.Sqrt(sumsq)/clip)
			}
			off := 0
			for p := range 3 {
				for j := range ps[p].Count {
					want := float64(math.Float32frombits(before.params[off+j])) - 0.5*exact(p, j)/coef
					if got := float64(bufs[p].val(j)); math.Abs(got-want) > 1e-6*(1+math.Abs(want)) {
						return fmt.Errorf("clip %v: param %d[%d] = %v, want %v", clip, p, j, got, want)
					}
				}
				off += ps[p].Count
			}
			return nil
		})
		everyRankIs(t, fmt.Sprintf("clip %v", clip), errs, nil)
		if norms[0] != norms[1] {
			t.Errorf("ranks disagree on the norm: %v and %v", norms[0], norms[1])
		}
	}
	// a NaN in bf16 with clipping skips, whatever KeepNonFinite says
	comms, _ := NewLocalGroup(1)
	ps, bufs := smallModel(BF16, 0)
	e, err := New(Config{Stage: 2, BucketBytes: 1024, Precision: PrecisionPolicy{KeepNonFinite: true}, Optimizer: OptimizerPolicy{Clip: 1, Groups: []Optimizer{NewSGD(0.5)}}}, comms[0], ps)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	before := snapshotState(e, bufs)
	for p := 2; p >= 0; p-- {
		g := newTBuf(BF16, ps[p].Count)
		if p == 0 {
			g.set(3, float32(math.NaN()))
		}
		if _, err := e.GradReady(p, g.t(), s); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.EndBackward(); err != nil {
		t.Fatal(err)
	}
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
	if !e.Stats().Skipped || !snapshotState(e, bufs).equal(before) {
		t.Errorf("a NaN gradient with clipping: skipped %v, state unchanged %v", e.Stats().Skipped, snapshotState(e, bufs).equal(before))
	}
}

// TestUnusedAndFrozen: a parameter no rank reports in the window keeps its
// bits and its optimizer state (no decay, no moment update, no step); a
// frozen one has no bucket, and reporting it is refused.
func TestUnusedAndFrozen(t *testing.T) {
	comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
	errs := eachRank(2, func(rank int) error {
		ps, bufs := smallModel(FP32, 1)
		e, err := New(Config{Stage: 2, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: []Optimizer{with(NewAdamW(0.1), func(o *AdamW) { o.WeightDecay = 0.5 })}}}, comms[rank], ps)
		if err != nil {
			return err
		}
		defer e.Close()
		if e.Plan().ParamBucket[3] != -1 {
			return fmt.Errorf("the frozen parameter has bucket %d", e.Plan().ParamBucket[3])
		}
		s := NewHostStream()
		defer s.Close()
		if _, err := e.GradReady(3, bufs[3].t(), s); !errors.Is(err, ErrParam) {
			return fmt.Errorf("reporting a frozen parameter: %v, want ErrParam", err)
		}
		for step := range 3 {
			for _, p := range []int{2, 0} { // parameter 1 never
				g := make([]float32, ps[p].Count)
				for j := range g {
					g[j] = float32(step+1) * 0.1
				}
				if _, err := e.GradReady(p, Float32s(g), s); err != nil {
					return err
				}
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
			if err := e.Step(); err != nil {
				return err
			}
		}
		if e.opt.steps[1] != 0 || e.opt.steps[0] != 3 {
			return fmt.Errorf("step counts %v, want 3 for the used parameters and 0 for the unused one", e.opt.steps)
		}
		for j := range ps[1].Count {
			if bufs[1].val(j) != 1+float32(j%7)/8 {
				return fmt.Errorf("the unused parameter changed at %d: %v", j, bufs[1].val(j))
			}
		}
		for j := range ps[3].Count {
			if bufs[3].val(j) != 1+float32(j%7)/8 {
				return fmt.Errorf("the frozen parameter changed at %d", j)
			}
		}
		rg := e.plan.shardRange(1, rank)
		for i := rg.ShardOffset; i < rg.ShardOffset+rg.Count; i++ {
			if e.opt.m.hostFloats()[i] != 0 || e.opt.v.hostFloats()[i] != 0 {
				return fmt.Errorf("the unused parameter's moments changed")
			}
			// the master too: a decayed master would surface as a jump the
			// next time the parameter is used
			j := rg.ParamOffset + i - rg.ShardOffset
			if e.opt.master.hostFloats()[i] != 1+float32(j%7)/8 {
				return fmt.Errorf("the unused parameter's master changed at %d: %v", j, e.opt.master.hostFloats()[i])
			}
		}
		if bufs[0].val(0) == 1 {
			return fmt.Errorf("a used parameter did not change")
		}
		return nil
	})
	everyRankIs(t, "unused and frozen", errs, nil)
}

// failureRun trains smallModel on two ranks for steps steps, the last one
// on a device armed to fail its failAt-th call (0: never), and returns each
// rank's error from that step, the state before and after it, the device
// and the bucket of every parameter element.
type failureRun struct {
	errs          []error
	before, after [2]engineState
	devs          [2]*failingDevice
	elemBucket    []int
	next          [2]error // a Step after the failure
	leaked        [2]int   // bytes still allocated after Close
}

func runFailure(stage int, dt DType, opt Optimizer, steps, failAt int) failureRun {
	var r failureRun
	comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
	r.errs = eachRank(2, func(rank int) error {
		counting := newCountingDevice()
		defer func() { r.leaked[rank] = counting.liveBytes(); counting.release() }()
		dev := &failingDevice{Device: counting, failAt: failAt}
		r.devs[rank] = dev
		ps, bufs := smallModel(dt, 0.5)
		// a window of 1: every clean step doubles the fp16 loss scale
		e, err := New(Config{Stage: stage, BucketBytes: 512, Precision: PrecisionPolicy{LossScale: LossScale{Window: 1}}, Optimizer: OptimizerPolicy{Groups: []Optimizer{opt}}}, onDevice{comms[rank], dev}, ps)
		if err != nil {
			return err
		}
		defer e.Close()
		if rank == 0 {
			for p := range 3 {
				for range ps[p].Count {
					r.elemBucket = append(r.elemBucket, e.plan.ParamBucket[p])
				}
			}
		}
		s := NewHostStream()
		defer s.Close()
		for step := range steps {
			for p := 2; p >= 0; p-- {
				g := newTBuf(dt, ps[p].Count)
				for j := range g.len() {
					g.set(j, float32(j%11-5)*float32(step+1+rank)/16)
				}
				if _, err := e.GradReady(p, g.t(), s); err != nil {
					return err
				}
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
			if step == steps-1 {
				r.before[rank] = snapshotState(e, bufs)
				dev.armed = true
			}
			err := e.Step()
			if step == steps-1 {
				dev.armed = false
				r.after[rank] = snapshotState(e, bufs)
				if err != nil {
					r.next[rank] = e.Step()
				}
			}
			if err != nil {
				return err
			}
		}
		return nil
	})
	return r
}

// TestFailedStepChangesNothing: a device that fails its n-th call during
// Step, for every n, makes Step return that error on every rank. Up to the
// commit point (the optimizer pass enqueued) the master, moments, step
// counts, loss scale and parameters are bit for bit as before the step.
// Past it the master and moments hold the step, exactly as a step without
// a failure leaves them, and each bucket's parameters are either all old
// or all new. Either way the engine refuses to go on.
func TestFailedStepChangesNothing(t *testing.T) {
	for _, stage := range []int{1, 2} {
		// SGD's momentum buffer is made by the first step, AdamW's moments by New
		for _, tc := range []struct {
			dt    DType
			opt   Optimizer
			steps int
		}{{FP32, with(NewSGD(0.1), func(o *SGD) { o.Momentum = 0.9 }), 1}, {FP16, with(NewAdamW(0.01), func(o *AdamW) { o.WeightDecay = 0.1 }), 2}} {
			ref := runFailure(stage, tc.dt, tc.opt, tc.steps, 0)
			everyRankIs(t, "reference", ref.errs, nil)
			calls, commit := ref.devs[0].calls, ref.devs[0].optimizeAt
			if commit == 0 {
				t.Fatalf("stage %d %T: the optimizer pass never ran", stage, tc.opt)
			}
			for n := 1; n <= calls; n++ {
				where := fmt.Sprintf("stage %d %v %T: failing call %d of %d (commit at %d)", stage, tc.dt, tc.opt, n, calls, commit)
				r := runFailure(stage, tc.dt, tc.opt, tc.steps, n)
				for rank := range 2 {
					if !errors.Is(r.errs[rank], errInjected) {
						t.Fatalf("%s: rank %d: Step returned %v, want the injected error", where, rank, r.errs[rank])
					}
					if r.leaked[rank] != 0 {
						t.Errorf("%s: rank %d: Close left %d bytes allocated", where, rank, r.leaked[rank])
					}
					if !errors.Is(r.next[rank], ErrCollective) {
						t.Errorf("%s: rank %d: the Step after the failure returned %v, want ErrCollective", where, rank, r.next[rank])
					}
					before, after, want := r.before[rank], r.after[rank], ref.after[rank]
					if n <= commit {
						if !after.equal(before) || after.scale != before.scale {
							t.Errorf("%s: rank %d: the failed step changed the state", where, rank)
						}
						continue
					}
					if !after.optimizerEqual(want) {
						t.Errorf("%s: rank %d: past the commit point the optimizer state is not the step's", where, rank)
					}
					old := map[int]bool{}
					for i, b := range ref.elemBucket {
						switch {
						case after.params[i] == before.params[i] && after.params[i] == want.params[i]:
						case after.params[i] == before.params[i]:
							old[b] = true
						case after.params[i] == want.params[i]:
							if old[b] {
								t.Errorf("%s: rank %d: bucket %d holds old and new parameters", where, rank, b)
							}
						default:
							t.Fatalf("%s: rank %d: parameter element %d is neither old nor new", where, rank, i)
						}
					}
				}
			}
		}
	}
}

// leavingComm counts its all-reduces and all-gathers from arm on; at the
// leaveAt-th it closes the communicator instead (the rank leaves the group).
type leavingComm struct {
	Comm
	armed          bool
	calls, leaveAt int
}

func (c *leavingComm) leaves() bool {
	if c.armed {
		c.calls++
		if c.calls == c.leaveAt {
			c.Comm.Close()
			return true
		}
	}
	return false
}

func (c *leavingComm) AllReduce(s Stream, t Tensor, op ReduceOp) error {
	if c.leaves() {
		return errorf(ErrPeerFailed, "the test made this rank leave")
	}
	return c.Comm.AllReduce(s, t, op)
}

func (c *leavingComm) AllGather(s Stream, send, recv Tensor) error {
	if c.leaves() {
		return errorf(ErrPeerFailed, "the test made this rank leave")
	}
	return c.Comm.AllGather(s, send, recv)
}

// TestPeerLeavesDuringTheNorm: rank 1 leaves at the norm's all-gather (the
// step's second all-reduce or all-gather, after the window's all-reduce);
// rank 0's Step fails with ErrPeerFailed from it, its state bit for bit as
// before.
func TestPeerLeavesDuringTheNorm(t *testing.T) {
	for _, stage := range []int{1, 2} {
		comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
		var before, after [2]engineState
		var calls [2]int
		errs := eachRank(2, func(rank int) error {
			c := &leavingComm{Comm: comms[rank]}
			if rank == 1 {
				c.leaveAt = 2
			}
			ps, bufs := smallModel(FP32, 0.5)
			e, err := New(Config{Stage: stage, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.01)}}}, c, ps)
			if err != nil {
				return err
			}
			defer e.Close()
			s := NewHostStream()
			defer s.Close()
			for p := 2; p >= 0; p-- {
				if _, err := e.GradReady(p, constGrads(ps, 0.5)[p], s); err != nil {
					return err
				}
			}
			if err := e.EndBackward(); err != nil {
				return err
			}
			before[rank] = snapshotState(e, bufs)
			c.armed = true
			err = e.Step()
			c.armed = false
			calls[rank] = c.calls
			after[rank] = snapshotState(e, bufs)
			return err
		})
		if !errors.Is(errs[0], ErrPeerFailed) || calls[0] != 2 {
			t.Errorf("stage %d: rank 0's Step returned %v in collective %d, want ErrPeerFailed in the second", stage, errs[0], calls[0])
		}
		for rank := range 2 {
			if !after[rank].equal(before[rank]) || after[rank].scale != before[rank].scale {
				t.Errorf("stage %d: rank %d: the failed step changed the state", stage, rank)
			}
		}
	}
}

// ---- memory -------------------------------------------------------------------

// memoryFormula is the engine's memory per rank from the plan, in bytes:
// gradients (the fp32 shard; ZeRO-1's fp32 local sums of every bucket, the
// bf16 staging buffers), the optimizer (fp32 master, m and v shards, the
// bf16 shard of the new parameters and the bf16 buffers they are gathered
// in) and the control buffers (the overflow flag; Step's check of 2 words,
// the groups' digest and a flag per parameter; the norm's float64 sums,
// one per 8192 elements of each bucket's shard and one per bucket, and its
// all-gather of 4 words per rank).
func memoryFormula(stage int, p *Plan, staging, gathers, world int) (grad, opt, control int64) {
	s, maxB := int64(p.ShardElems), int64(p.MaxBucket())
	grad = 4*s + int64(staging)*maxB*2
	control = 4 + 4*int64(2+2*3+len(p.ParamBucket)) + 4*4*int64(world)
	for _, b := range p.Buckets {
		control += 8 * int64((b.Shard+8191)/8192+1)
	}
	if stage == 1 {
		for _, b := range p.Buckets {
			grad += 4 * int64(b.Elems)
		}
	}
	opt = 12*s + 2*s + int64(gathers)*maxB*2
	return grad, opt, control
}

// TestMemoryFormula: the stats' gradient and optimizer bytes after a step
// equal the formula from the plan, for ZeRO-1 and ZeRO-2, one bucket or
// several, W 1 to 4.
func TestMemoryFormula(t *testing.T) {
	for _, stage := range []int{1, 2} {
		for _, world := range []int{1, 2, 3, 4} {
			for _, bucket := range []int{1 << 20, 64 << 10} {
				st, plan := memoryRun(t, stage, world, 3, 200, bucket)
				// The gather buffers ping-pong: one is reused when the
				// previous bucket's copy has finished, so 1 or 2 are held.
				grad, opt, control := memoryFormula(stage, plan, st.StagingBuffers, 1, world)
				_, opt2, _ := memoryFormula(stage, plan, st.StagingBuffers, min(2, len(plan.Buckets)), world)
				if st.PeakGradBytes != grad || st.OptimizerBytes != opt && st.OptimizerBytes != opt2 || st.ControlBytes != control {
					t.Errorf("ZeRO-%d W=%d bucket %d (%d buckets): stats grad %d opt %d control %d bytes, formula %d, %d and %d",
						stage, world, bucket, len(plan.Buckets), st.PeakGradBytes, st.OptimizerBytes, st.ControlBytes, grad, opt2, control)
				}
			}
		}
	}
}

// ---- the optimizer against formulas written from PyTorch's and zero's docs ----

// TestNormAndClipUnderLossScale: with fp16 gradients scaled by a static or
// a dynamic loss scale, Stats.GradNorm is the norm of the unscaled mean
// gradient and clipping uses it: SGD's update is -lr·mean/max(1,
// norm/Clip), checked on the fp32 master against float64.
func TestNormAndClipUnderLossScale(t *testing.T) {
	sizes := []int{300, 7, 1000}
	// exact in fp16 once scaled by 1024: (1 + j%5)(k+1)(rank+1)/256
	grad := func(st, k, rank, p, j int) float64 { return float64((1+j%5)*(k+1)*(rank+1)) / 256 }
	mean := func(j int) float64 { return float64(1+j%5) * 3 * 3 / (4 * 256) }
	sumsq := 0.0
	for _, n := range sizes {
		for j := range n {
			sumsq += mean(j) * mean(j)
		}
	}
	norm := math.Sqrt(sumsq)
	for _, ls := range []LossScale{{Static: 1024}, {Initial: 1024}} {
		for _, clip := range []float64{0, norm / 4, norm * 4} {
			c := optCase{
				cfg:   Config{Stage: 2, BucketBytes: 1024, Precision: PrecisionPolicy{LossScale: ls}, Optimizer: OptimizerPolicy{Clip: clip, Groups: []Optimizer{NewSGD(0.5)}}},
				sizes: sizes, dt: FP16, backwards: 2, steps: 1, grad: grad,
				init: func(p, j int) float32 { return float32(j%9) / 8 },
			}
			tr := runOpt(t, c)
			what := fmt.Sprintf("loss scale %+v clip %.4g", ls, clip)
			for rank := range 2 {
				st := tr.stats[rank][0]
				if st.LossScale != 1024 || st.Skipped {
					t.Fatalf("%s: rank %d: scale %v skipped %v", what, rank, st.LossScale, st.Skipped)
				}
				closeTo(t, what+": GradNorm", st.GradNorm, norm, 1e-6, 0)
			}
			coef := 1.0
			if clip > 0 {
				coef = max(1, norm/clip)
			}
			for p, n := range sizes {
				for j := range n {
					want := float64(j%9)/8 - 0.5*mean(j)/coef
					closeTo(t, fmt.Sprintf("%s: master %d[%d]", what, p, j), tr.master[0][p][j], want, 4e-7, 1e-9)
				}
			}
		}
	}
}

// TestClipCoefficient: the clip coefficient is max(1, norm/Clip), with no
// epsilon (DeepSpeed's (norm + 1e-6)/Clip differs from it by 1e-6/Clip).
// A tiny gradient from zero parameters makes the update itself the
// measure, so fp32's relative precision sees the difference.
func TestClipCoefficient(t *testing.T) {
	sizes := []int{300, 7, 1000}
	grad := func(st, k, rank, p, j int) float64 { return float64(1+j%5) * 1e-6 * float64(rank+1) }
	mean := func(j int) float64 { return float64(1+j%5) * 1e-6 * 1.5 }
	sumsq := 0.0
	for _, n := range sizes {
		for j := range n {
			sumsq += mean(j) * mean(j)
		}
	}
	norm := math.Sqrt(sumsq)
	for _, clip := range []float64{norm / 10, norm * 0.999, norm * 2} {
		c := optCase{
			cfg:   Config{Stage: 1, BucketBytes: 1024, Optimizer: OptimizerPolicy{Clip: clip, Groups: []Optimizer{NewSGD(1)}}},
			sizes: sizes, dt: FP32, backwards: 1, steps: 1, grad: grad,
			init: func(p, j int) float32 { return 0 },
		}
		tr := runOpt(t, c)
		coef := max(1, norm/clip)
		for p, n := range sizes {
			for j := range n {
				closeTo(t, fmt.Sprintf("clip %.4g (norm %.4g): master %d[%d]", clip, norm, p, j), tr.master[0][p][j], -mean(j)/coef, 1e-6, 0)
			}
		}
	}
}

// TestSetGroupTakesEffect: SetGroup's settings are the ones the next step
// uses (and the steps after it), for the group changed only: SGD's rate,
// rate 0 included, and AdamW's rate and weight decay, each against
// float64.
func TestSetGroupTakesEffect(t *testing.T) {
	sizes := []int{300, 7, 1000}
	grad := func(st, k, rank, p, j int) float64 { return float64(1+(j+st)%5) / 64 * float64(rank+1) }
	mean := func(st, j int) float64 { return float64(1+(j+st)%5) / 64 * 1.5 }
	init := func(p, j int) float32 { return float32(j%9) / 8 }

	sgdRates := []float64{0.25, 0.5, 0, 0.125} // group 1's rate per step; group 0 stays at 0.25
	c := optCase{
		cfg:   Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.25), NewSGD(0.25)}}},
		sizes: sizes, dt: FP32, backwards: 1, steps: len(sgdRates), grad: grad, init: init,
		before: func(e *Engine, st int) error { return e.SetGroup(1, NewSGD(sgdRates[st])) },
	}
	tr := runOpt(t, c)
	for p, n := range sizes {
		for j := range n {
			want := float64(init(p, j))
			for st := range sgdRates {
				lr := 0.25
				if p > 0 { // parameters 1 and 2 are in group 1
					lr = sgdRates[st]
				}
				want -= lr * mean(st, j)
				closeTo(t, fmt.Sprintf("SGD step %d: master %d[%d]", st, p, j), tr.master[st][p][j], want, 1e-6, 1e-7)
			}
		}
	}

	adam := []AdamW{NewAdamW(0.01), with(NewAdamW(0.02), func(o *AdamW) { o.WeightDecay = 0.5 }), NewAdamW(0), with(NewAdamW(0.005), func(o *AdamW) { o.WeightDecay = 0.1 })}
	c = optCase{
		cfg:   Config{Stage: 1, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.01), NewAdamW(0.01)}}},
		sizes: sizes, dt: FP32, backwards: 1, steps: len(adam), grad: grad, init: init,
		before: func(e *Engine, st int) error { return e.SetGroup(1, adam[st]) },
	}
	tr = runOpt(t, c)
	for p, n := range sizes {
		for j := range n {
			theta, m, v := float64(init(p, j)), 0.0, 0.0
			for st, o := range adam {
				if p == 0 {
					o = NewAdamW(0.01)
				}
				ref := refAdamW{lr: o.LR, b1: 0.9, b2: 0.999, eps: 1e-8, wd: o.WeightDecay}
				ref.step(&theta, &m, &v, mean(st, j), st+1)
				closeTo(t, fmt.Sprintf("AdamW step %d: master %d[%d]", st, p, j), tr.master[st][p][j], theta, 1e-6, 1e-7)
			}
		}
	}
}

// TestSGDMatchesTorch: torch.optim.SGD's update, written here from its
// documentation: g += wd·p; the first step's buffer is g itself (no
// dampening), later ones b = momentum·b + (1−dampening)·g; Nesterov uses
// g + momentum·b; p −= lr·(that). Five steps of random gradients on two
// ranks, against float64.
func TestSGDMatchesTorch(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewSource(seed))
	sizes := []int{300, 7, 1000}
	const steps = 5
	noise := make([][][][]float64, steps) // [step][rank][param][element]
	for st := range noise {
		noise[st] = make([][][]float64, 2)
		for r := range 2 {
			for _, n := range sizes {
				x := make([]float64, n)
				for j := range x {
					x[j] = float64(float32(rng.NormFloat64()))
				}
				noise[st][r] = append(noise[st][r], x)
			}
		}
	}
	grad := func(st, k, rank, p, j int) float64 { return noise[st][rank][p][j] }
	init := func(p, j int) float32 { return float32(j%9)/8 - 0.5 }
	for _, o := range []SGD{
		with(NewSGD(0.1), func(o *SGD) { o.Momentum, o.Dampening, o.WeightDecay = 0.9, 0.5, 0.01 }),
		with(NewSGD(0.1), func(o *SGD) { o.Momentum, o.WeightDecay, o.Nesterov = 0.9, 0.01, true }),
		with(NewSGD(0.05), func(o *SGD) { o.Momentum, o.Dampening = 0.5, 1 }),
		with(NewSGD(0.1), func(o *SGD) { o.WeightDecay = 0.1 }),
	} {
		tr := runOpt(t, optCase{
			cfg:   Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{o}}},
			sizes: sizes, dt: FP32, backwards: 1, steps: steps, grad: grad, init: init,
		})
		for p, n := range sizes {
			for j := range n {
				theta, buf := float64(init(p, j)), 0.0
				for st := range steps {
					g := (noise[st][0][p][j]+noise[st][1][p][j])/2 + o.WeightDecay*theta
					if o.Momentum != 0 {
						if st == 0 {
							buf = g
						} else {
							buf = o.Momentum*buf + (1-o.Dampening)*g
						}
						if o.Nesterov {
							g += o.Momentum * buf
						} else {
							g = buf
						}
					}
					theta -= o.LR * g
					closeTo(t, fmt.Sprintf("%+v step %d: master %d[%d] (seed %d)", o, st, p, j, seed), tr.master[st][p][j], theta, 1e-5, 1e-6)
				}
			}
		}
	}
}

// TestMeanAfterASkippedStep: a skipped step consumes its window, so the
// next step's mean divides by its own backwards only.
func TestMeanAfterASkippedStep(t *testing.T) {
	params, _ := smallModel(FP32, 0.5)
	for _, stage := range []int{1, 2} {
		cfg := Config{Stage: stage, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(0.01)}}}
		errs := onEngines(2, 20*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
			bad := constGrads(params[:3], 1)
			if e.Rank() == 1 {
				bad[2].hostFloats()[5] = float32(math.NaN())
			}
			for range 2 {
				if err := backward(e, s, bad); err != nil {
					return err
				}
			}
			if err := e.Step(); err != nil {
				return err
			}
			if !e.Stats().Skipped {
				return fmt.Errorf("a NaN gradient did not skip the step")
			}
			for _, v := range []float32{1, 3} {
				if err := backward(e, s, constGrads(params[:3], v)); err != nil {
					return err
				}
			}
			if err := e.Step(); err != nil {
				return err
			}
			if st := e.Stats(); st.Skipped || st.Backwards != 2 {
				return fmt.Errorf("the step after the skip: skipped %v, %d backwards, want 2", st.Skipped, st.Backwards)
			}
			full, err := e.FullGrads()
			if err != nil {
				return err
			}
			return wantAll(full[:3], 2)
		})
		everyRankIs(t, fmt.Sprintf("stage %d", stage), errs, nil)
	}
}

// TestStepCollectives: Stats.Collectives counts every collective of the
// step: with an optimizer at stages 1 and 2, the all-gather of each
// bucket's new parameters (its padded bytes in the model dtype) beside the
// reductions, the window's all-reduce and the norm's all-gather.
func TestStepCollectives(t *testing.T) {
	for _, stage := range []int{1, 2} {
		for _, dt := range []DType{FP32, BF16} {
			params, _ := smallModel(dt, 0.5)
			cfg := Config{Stage: stage, BucketBytes: 512, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.01)}}}
			errs := onEngines(2, 20*time.Second, cfg, params, func(e *Engine, s *HostStream) error {
				g := make([]Tensor, 3)
				for p := range g {
					g[p] = newTBuf(dt, params[p].Count).t()
				}
				if err := backward(e, s, g); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
				got, plan := e.Stats().Collectives, e.Plan()
				var want CommCounters
				for _, b := range plan.Buckets {
					want[KindReduceScatter].Calls++
					want[KindReduceScatter].PayloadBytes += int64(b.Padded * dt.Size())
					want[KindAllGather].Calls++
					want[KindAllGather].PayloadBytes += int64(b.Padded * dt.Size())
				}
				// the window's check, and the norm's all-gather of every rank's sums
				want[KindAllReduce].Calls = 1
				want[KindAllGather].Calls++
				want[KindAllGather].PayloadBytes += int64(4 * normWords * e.World())
				for k := range want {
					if got[k].Calls != want[k].Calls || k != int(KindAllReduce) && got[k].PayloadBytes != want[k].PayloadBytes {
						return fmt.Errorf("%v: %+v, want %+v", CollectiveKind(k), got[k], want[k])
					}
				}
				return nil
			})
			everyRankIs(t, fmt.Sprintf("stage %d %v", stage, dt), errs, nil)
		}
	}
}

// TestNormBeyondFP32: a finite gradient whose global norm is far above
// what an fp32 sum of squares holds (each element 1e19, the sum of squares
// about 1e41) is clipped, not skipped as non-finite, and the norm is exact
// to float64's reference.
func TestNormBeyondFP32(t *testing.T) {
	sizes := []int{300, 7, 1000}
	grad := func(st, k, rank, p, j int) float64 { return float64(1+j%5) * 1e19 * float64(rank+1) }
	mean := func(j int) float64 { return float64(1+j%5) * 1e19 * 1.5 }
	sumsq := 0.0
	for _, n := range sizes {
		for j := range n {
			sumsq += mean(j) * mean(j)
		}
	}
	norm := math.Sqrt(sumsq)
	for _, stage := range []int{1, 2} {
		tr := runOpt(t, optCase{
			cfg:   Config{Stage: stage, BucketBytes: 1024, Optimizer: OptimizerPolicy{Clip: 1, Groups: []Optimizer{NewSGD(1)}}},
			sizes: sizes, dt: FP32, backwards: 2, steps: 1, grad: grad,
			init: func(p, j int) float32 { return 0 },
		})
		for rank := range 2 {
			st := tr.stats[rank][0]
			if st.Skipped {
				t.Fatalf("stage %d: a finite gradient of norm %.3g was skipped", stage, norm)
			}
			closeTo(t, fmt.Sprintf("stage %d rank %d: GradNorm", stage, rank), st.GradNorm, norm, 1e-6, 0)
		}
		for p, n := range sizes {
			for j := range n {
				closeTo(t, fmt.Sprintf("stage %d: master %d[%d]", stage, p, j), tr.master[0][p][j], -mean(j)/norm, 1e-6, 0)
			}
		}
	}
}
