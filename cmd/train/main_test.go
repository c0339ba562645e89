package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"zero"
)

// Example trains the MLP for five steps on two ranks (ZeRO-2, AdamW) and
// prints each step as it ends: the mean loss of its global batch, the
// learning rate, the loss scale, the global gradient norm and the
// throughput (which varies from run to run: N here).
func Example() {
	c := defaultConfig()
	c.steps = 5
	var out strings.Builder
	if _, err := run(&out, c); err != nil {
		fmt.Println(err)
	}
	fmt.Print(throughput.ReplaceAllString(out.String(), "N samples/s"))
	// Output:
	// MLP 4→16→1 on 2 ranks, ZeRO-2, AdamW lr 0.01, global batch 24 in 1 backward(s) per step
	// step  1  loss 130.2793  lr 0.01  scale 1  norm 35.46  N samples/s
	// step  2  loss 133.3672  lr 0.01  scale 1  norm 36.31  N samples/s
	// step  3  loss 124.4466  lr 0.01  scale 1  norm 35.89  N samples/s
	// step  4  loss 121.9456  lr 0.01  scale 1  norm 36.52  N samples/s
	// step  5  loss 117.9970  lr 0.01  scale 1  norm 36.48  N samples/s
}

// throughput is a printed step's samples per second.
var throughput = regexp.MustCompile(`[0-9]+ samples/s`)

// traced is the default run with its history kept: every step's
// parameters, stats and times, which the tests read.
func traced() config {
	c := defaultConfig()
	c.trace = true
	return c
}

// testSeed is ZERO_TEST_SEED, or the clock; the test logs it for a replay.
func testSeed(t *testing.T) int64 {
	seed := time.Now().UnixNano()
	if s := os.Getenv("ZERO_TEST_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("ZERO_TEST_SEED=%q: %v", s, err)
		}
		seed = v
	}
	t.Logf("seed %d (rerun with ZERO_TEST_SEED=%d)", seed, seed)
	return seed
}

// TestBackwardMatchesFiniteDifferences: the hand-written backward against
// central differences of the loss, in float64.
func TestBackwardMatchesFiniteDifferences(t *testing.T) {
	seed := testSeed(t)
	c := defaultConfig()
	c.seed = seed
	m := mlp{c.in, c.hidden}
	th := m.initial(rand.New(rand.NewSource(seed)))
	d := makeData(c)
	xs, ys := d.x[0][:5], d.y[0][:5]
	b, _ := m.forwardBatch(layersOf(th), xs, ys)
	g := make([][]float64, 4)
	for p, n := range m.sizes() {
		g[p] = make([]float64, n)
	}
	m.backwardOutput(b, g[2], g[3])
	m.backwardHidden(th[2], b, g[0], g[1])
	const h = 1e-6
	for p := range th {
		for i := range th[p] {
			x := th[p][i]
			th[p][i] = x + h
			_, lp := m.forwardBatch(layersOf(th), xs, ys)
			th[p][i] = x - h
			_, lm := m.forwardBatch(layersOf(th), xs, ys)
			th[p][i] = x
			fd := (lp - lm) / (2 * h)
			if math.Abs(fd-g[p][i]) > 1e-5*(1+math.Abs(fd)) {
				t.Fatalf("%s[%d]: backward %.9g, finite difference %.9g", tensorNames[p], i, g[p][i], fd)
			}
		}
	}
}

// reference is single-process training on the same global batch, in
// float64: the mean gradient over the batch and torch.optim.AdamW, with the
// example's two groups (weights decay, biases do not).
type reference struct {
	c       config
	m       mlp
	theta   [][]float64
	mom, v  [][]float64
	b1, b2  float64
	eps     float64
	updates [][]float64 // the last step's update direction u per element
}

func newReference(c config, theta0 [][]float64) *reference {
	r := &reference{c: c, m: mlp{c.in, c.hidden}, b1: 0.9, b2: 0.999, eps: 1e-8}
	for _, x := range theta0 {
		r.theta = append(r.theta, append([]float64(nil), x...))
		r.mom = append(r.mom, make([]float64, len(x)))
		r.v = append(r.v, make([]float64, len(x)))
		r.updates = append(r.updates, make([]float64, len(x)))
	}
	return r
}

// grads returns the mean gradient of each micro-batch of step st at th, in
// the engine's order of micro-batches (rank by rank).
func (r *reference) grads(th [][]float64, d dataset, st int) [][][]float64 {
	var out [][][]float64
	for rank := range r.c.world {
		for k := range r.c.accum {
			from, to := r.c.microBatch(rank, k)
			b, _ := r.m.forwardBatch(layersOf(th), d.x[st][from:to], d.y[st][from:to])
			g := make([][]float64, 4)
			for p, n := range r.m.sizes() {
				g[p] = make([]float64, n)
			}
			r.m.backwardOutput(b, g[2], g[3])
			r.m.backwardHidden(th[2], b, g[0], g[1])
			out = append(out, g)
		}
	}
	return out
}

// mean is the mean of the micro-batches' gradients: the global batch's.
func mean(gs [][][]float64) [][]float64 {
	out := make([][]float64, len(gs[0]))
	for p := range out {
		out[p] = make([]float64, len(gs[0][p]))
		for _, g := range gs {
			for i, x := range g[p] {
				out[p][i] += x
			}
		}
		scaleBy(out[p], 1/float64(len(gs)))
	}
	return out
}

// step applies AdamW step t (from 1) with gradient g.
func (r *reference) step(g [][]float64, t int) {
	for p := range r.theta {
		wd := 0.0
		if tensorGroups[p] == 0 {
			wd = r.c.weightDecay
		}
		for i := range r.theta[p] {
			r.theta[p][i] *= 1 - r.c.lr*wd
			r.mom[p][i] += (1 - r.b1) * (g[p][i] - r.mom[p][i])
			r.v[p][i] = r.v[p][i]*r.b2 + (1-r.b2)*g[p][i]*g[p][i]
			bc1, bc2 := 1-math.Pow(r.b1, float64(t)), 1-math.Pow(r.b2, float64(t))
			u := (r.mom[p][i] / bc1) / (math.Sqrt(r.v[p][i]/bc2) + r.eps)
			r.updates[p][i] = u
			r.theta[p][i] -= r.c.lr * u
		}
	}
}

// TestMatchesSingleRankTraining: the example on W ranks against the float64
// reference on the same global batch, for stages 1, 2 and 3, W 1, 2 and 4, 1
// and 3 backwards per step, fp32 and bf16, 20 steps. The bound is that of
// TestTrainingEquivalence in the zero package, carried element by element
// along the reference trajectory:
//   - the gradient the engine steps with differs from the reference's by
//     the rounding of each micro-batch's gradient to the model dtype
//     (u_d·A, A the mean of the micro-batch gradients' magnitudes), the
//     reduction's (W+G+6)(u_d+u32)·A (the bound of checkMean), and the
//     gradient's change between the engine's parameters and the
//     reference's, which for a network (unlike that test's quadratic) is
//     computed here, in float64, at both points rather than bounded from
//     above;
//   - as long as every element's gradient keeps its sign over the run
//     (checked: positive inputs, a positive W2 and targets above every
//     output the start can reach make it so), a relative gradient error ρ
//     (plus 8u32 per step for the fp32 moments) moves the AdamW update by at
//     most 2ρ/(1−ρ) of its size;
//   - the step's fp32 arithmetic adds u32(4|θ| + 32·lr·|u|);
//
// so dθ ← dθ(1 − lr·wd) + lr·|u|·2ρ/(1−ρ) + u32(4|θ| + 32·lr·|u|), and after
// every step the engine's parameters must be within dθ plus one rounding
// to the model dtype of the reference's.
func TestMatchesSingleRankTraining(t *testing.T) {
	seed := testSeed(t)
	const u32 = 0x1p-24
	for _, dt := range []zero.DType{zero.FP32, zero.BF16} {
		ud := u32
		if dt == zero.BF16 {
			ud = 0x1p-8
		}
		for _, stage := range []int{1, 2, 3} {
			for _, world := range []int{1, 2, 4} {
				for _, accum := range []int{1, 3} {
					c := traced()
					c.seed, c.stage, c.world, c.accum, c.dtype, c.steps = seed, stage, world, accum, dt, 20
					name := fmt.Sprintf("%v ZeRO-%d W=%d G=%d", dt, stage, world, accum)
					res, err := run(nil, c)
					if err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					data := makeData(c)
					ref := newReference(c, res.params[0])
					dtheta, rho, sign := make([][]float64, 4), make([][]float64, 4), make([][]float64, 4)
					for p, n := range ref.m.sizes() {
						dtheta[p], rho[p], sign[p] = make([]float64, n), make([]float64, n), make([]float64, n)
					}
					worst := 0.0
					for st := range c.steps {
						gz := ref.grads(res.params[st], data, st) // at the engine's parameters
						gr := mean(ref.grads(ref.theta, data, st))
						gzMean := mean(gz)
						S := float64(len(gz))
						for p := range gr {
							for i, g := range gr[p] {
								a := 0.0
								for _, mb := range gz {
									a += math.Abs(mb[p][i]) / S
								}
								if s := math.Copysign(1, g); sign[p][i] == 0 {
									sign[p][i] = s
								} else if s != sign[p][i] || g == 0 {
									t.Fatalf("%s step %d: %s[%d]'s gradient changes sign; the bound needs one sign", name, st+1, tensorNames[p], i)
								}
								e := ud*a + float64(world+accum+6)*(ud+u32)*a*(1+ud) + math.Abs(gzMean[p][i]-g) + 1e-12*(a+math.Abs(g))
								rho[p][i] = max(rho[p][i], e/math.Abs(g)) + 8*u32
								if rho[p][i] >= 0.5 {
									t.Fatalf("%s step %d: %s[%d]: relative gradient error bound %g; the run leaves the regime", name, st+1, tensorNames[p], i, rho[p][i])
								}
							}
						}
						ref.step(gr, st+1)
						for p := range gr {
							wd := 0.0
							if tensorGroups[p] == 0 {
								wd = c.weightDecay
							}
							for i := range gr[p] {
								u, th, r := math.Abs(ref.updates[p][i]), ref.theta[p][i], rho[p][i]
								dtheta[p][i] = dtheta[p][i]*(1-c.lr*wd) + c.lr*u*2*r/(1-r) + u32*(4*math.Abs(th)+32*c.lr*u)
								allowed := dtheta[p][i] + ud*(math.Abs(th)+dtheta[p][i])
								got := res.params[st+1][p][i]
								if d := math.Abs(got - th); !(d <= allowed) {
									t.Fatalf("%s step %d: %s[%d] = %.9g, reference %.9g: |diff| %.3g > bound %.3g", name, st+1, tensorNames[p], i, got, th, d, allowed)
								} else {
									worst = max(worst, d/allowed)
								}
							}
						}
					}
					t.Logf("%s: after %d steps the largest parameter difference is %.2f of its bound", name, c.steps, worst)
				}
			}
		}
	}
}

// sameParams fails t unless two runs' parameters have the same bits after
// every step.
func sameParams(t *testing.T, what string, got, want result) {
	t.Helper()
	for st := range want.params {
		for p := range want.params[st] {
			for i, x := range want.params[st][p] {
				if y := got.params[st][p][i]; math.Float64bits(x) != math.Float64bits(y) {
					t.Fatalf("%s: step %d: %s[%d] = %v, want %v", what, st, tensorNames[p], i, y, x)
				}
			}
		}
	}
}

// TestStage3MatchesStage2: the example at stage 3 (parameters sharded,
// gathered layer by layer in forward and again for the backward) gives
// stage 2's bits after every step.
func TestStage3MatchesStage2(t *testing.T) {
	seed := testSeed(t)
	for _, dt := range []zero.DType{zero.FP32, zero.BF16} {
		for _, world := range []int{1, 2, 4} {
			c := traced()
			c.seed, c.world, c.dtype, c.steps, c.accum = seed, world, dt, 8, 2
			c.stage = 2
			want, err := run(nil, c)
			if err != nil {
				t.Fatal(err)
			}
			c.stage = 3
			got, err := run(nil, c)
			if err != nil {
				t.Fatal(err)
			}
			sameParams(t, fmt.Sprintf("%v W=%d at stage 3 against stage 2", dt, world), got, want)
			if h := got.stats[len(got.stats)-1].PrefetchHits; h == 0 {
				t.Errorf("%v W=%d: no prefetch hit in the last step", dt, world)
			}
		}
	}
}

// TestOffloadMatchesDevice: the example with offload (gradient shard,
// master weights and moments on the host, AdamW there) gives the bits of
// the run without it after every step, at stages 1 to 3.
func TestOffloadMatchesDevice(t *testing.T) {
	seed := testSeed(t)
	for _, dt := range []zero.DType{zero.FP32, zero.BF16} {
		for _, stage := range []int{1, 2, 3} {
			c := traced()
			c.seed, c.world, c.dtype, c.steps, c.accum, c.stage = seed, 2, dt, 8, 3, stage
			want, err := run(nil, c)
			if err != nil {
				t.Fatal(err)
			}
			c.offload = true
			got, err := run(nil, c)
			if err != nil {
				t.Fatal(err)
			}
			sameParams(t, fmt.Sprintf("%v stage %d with offload against without", dt, stage), got, want)
			if s := got.stats[len(got.stats)-1]; s.HostBytes == 0 || s.DeviceBytesSaved == 0 {
				t.Errorf("%v stage %d: host bytes %d, device bytes saved %d", dt, stage, s.HostBytes, s.DeviceBytesSaved)
			}
		}
	}
}

// lossLines are a run's printed step lines, the throughput left out.
func lossLines(out string) []string {
	var ls []string
	for l := range strings.Lines(out) {
		if strings.HasPrefix(l, "step ") {
			ls = append(ls, throughput.ReplaceAllString(l, "N samples/s"))
		}
	}
	return ls
}

// resumeCase is TestResumeMatchesUninterrupted's model: 12 steps of 2
// backwards on 2 ranks; fp16 with a dynamic scale that starts at 2048 and
// doubles after 2 good steps, so it overflows again and again (skipped
// steps on both sides of the save).
func resumeCase(seed int64, dt zero.DType, stage int, offload bool) config {
	c := traced()
	c.seed, c.dtype, c.stage, c.offload, c.steps, c.accum = seed, dt, stage, offload, 12, 2
	if dt == zero.FP16 {
		c.lossScale = zero.LossScale{Initial: 2048, Window: 2}
	}
	return c
}

// saveStep is where a resume test stops its first run: halfway, or in fp16
// the first step after which the run has taken a step and skipped one
// (the scaler's hysteresis and counters moved) and skips again later.
func saveStep(t *testing.T, straight result, dt zero.DType) int {
	t.Helper()
	n := len(straight.stats)
	if dt != zero.FP16 {
		return n / 2
	}
	skipped := func(from, to int) (taken, skips int) {
		for _, s := range straight.stats[from:to] {
			if s.Skipped {
				skips++
			} else {
				taken++
			}
		}
		return
	}
	for k := 1; k < n; k++ {
		taken, skips := skipped(0, k)
		_, later := skipped(k, n)
		if taken > 0 && skips > 0 && later > 0 && straight.stats[k].LossScale != straight.stats[0].LossScale {
			return k
		}
	}
	t.Fatalf("fp16: the scale never overflowed on both sides of any step (scales %v): the test would not cover the scaler", scales(straight))
	return 0
}

func scales(r result) []string {
	var s []string
	for _, st := range r.stats {
		s = append(s, fmt.Sprintf("%g skipped %v", st.LossScale, st.Skipped))
	}
	return s
}

// TestResumeMatchesUninterrupted: a run of N steps, and a run of K steps
// with -save followed by a run with -resume and -steps N, end with the
// same bits after every step from K on (parameters), and print the same
// loss lines for steps K+1 to N (the loss of each global batch: the data
// came back to its position), in fp32, bf16 and fp16 (whose dynamic scale
// overflowed, skipped steps and moved before the save and after it), at
// stages 1, 2 and 3, with and without offload.
func TestResumeMatchesUninterrupted(t *testing.T) {
	seed := testSeed(t)
	for _, dt := range []zero.DType{zero.FP32, zero.BF16, zero.FP16} {
		for _, stage := range []int{1, 2, 3} {
			for _, offload := range []bool{false, true} {
				name := fmt.Sprintf("%v ZeRO-%d offload %v", dt, stage, offload)
				c := resumeCase(seed, dt, stage, offload)
				var whole bytes.Buffer
				straight, err := run(&whole, c)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				k := saveStep(t, straight, dt)
				dir := t.TempDir()
				first := c
				first.steps, first.save = k, dir
				var head bytes.Buffer
				saved, err := run(&head, first)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if !slices.Equal(saved.saved, []int{k}) {
					t.Fatalf("%s: checkpoints after steps %v, want %d", name, saved.saved, k)
				}
				second := c
				second.resume = dir
				var tail bytes.Buffer
				resumed, err := run(&tail, second)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if resumed.first != k || len(resumed.loss) != c.steps-k {
					t.Fatalf("%s: the resumed run took steps %d to %d, want %d to %d", name, resumed.first+1, resumed.first+len(resumed.loss), k+1, c.steps)
				}
				sameParams(t, name+": resumed against uninterrupted", resumed, result{params: straight.params[k:]})
				want := lossLines(whole.String())
				if got := lossLines(head.String() + tail.String()); !slices.Equal(got, want) {
					t.Fatalf("%s: the saved and resumed runs printed\n%s\nthe uninterrupted one\n%s", name, strings.Join(got, ""), strings.Join(want, ""))
				}
			}
		}
	}
}

// TestSaveEvery: -save-every 3 with -steps 8 writes checkpoints after
// steps 3, 6 and 8; resuming from the one of step 6 (a directory of its
// own) ends with the uninterrupted run's bits, and from the directory
// (its latest, step 8) runs no step and holds the final parameters.
func TestSaveEvery(t *testing.T) {
	seed := testSeed(t)
	c := traced()
	c.seed, c.steps, c.dtype = seed, 8, zero.BF16
	straight, err := run(nil, c)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	every := c
	every.save, every.saveEvery, every.keep = dir, 3, 3
	var out bytes.Buffer
	saved, err := run(&out, every)
	if err != nil {
		t.Fatal(err)
	}
	sameParams(t, "the run that saves against the one that does not", saved, straight)
	if !slices.Equal(saved.saved, []int{3, 6, 8}) || strings.Count(out.String(), "saved in "+dir) != 3 {
		t.Fatalf("checkpoints after steps %v, want [3 6 8]; printed\n%s", saved.saved, out.String())
	}
	var ckpts []string
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() {
			ckpts = append(ckpts, e.Name())
		}
	}
	if len(ckpts) != 3 {
		t.Fatalf("%s holds %v; want the 3 checkpoints -keep 3 keeps", dir, ckpts)
	}
	from6 := c
	from6.resume = filepath.Join(dir, ckpts[1]) // the names sort by step
	resumed, err := run(nil, from6)
	if err != nil {
		t.Fatal(err)
	}
	if resumed.first != 6 {
		t.Fatalf("resumed from %s after step %d, want 6", ckpts[1], resumed.first)
	}
	sameParams(t, "resumed from step 6", resumed, result{params: straight.params[6:]})
	latest := c
	latest.resume = dir
	done, err := run(nil, latest)
	if err != nil {
		t.Fatal(err)
	}
	if done.first != 8 || len(done.loss) != 0 {
		t.Fatalf("resumed from %s's latest after step %d with %d steps to go, want 8 and 0", dir, done.first, len(done.loss))
	}
	sameParams(t, "resumed from the latest", done, result{params: straight.params[8:]})
}

// TestResumeAtAnotherSplit: a run of 2 ranks with 2 backwards a step,
// saved halfway, resumes on 1 rank with 4 (-world 1 -accum 4: the same
// global batch, split otherwise), and a run of 1×4 on 2×2 (the new rank
// gets rank 0's data position). The resume prints in one line what the
// load resharded (the world size, how many parameters were placed anew: a
// parameter that stays on rank 0 at its place is not), and trains
// on the uninterrupted run's data: its parameters after every step within
// 1e-6 of that run's (summed in another order; a step on other data moves
// them by about the rate, 0.01). A resume at the same split prints no such
// line.
func TestResumeAtAnotherSplit(t *testing.T) {
	seed := testSeed(t)
	for _, sp := range [][2][2]int{{{2, 2}, {1, 4}}, {{1, 4}, {2, 2}}, {{2, 2}, {2, 2}}} {
		c := traced()
		c.seed, c.steps, c.world, c.accum = seed, 8, sp[0][0], sp[0][1]
		name := fmt.Sprintf("W%d×%d → W%d×%d", sp[0][0], sp[0][1], sp[1][0], sp[1][1])
		straight, err := run(nil, c)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		dir := t.TempDir()
		first := c
		first.steps, first.save = 4, dir
		if _, err := run(nil, first); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		second := c
		second.resume, second.world, second.accum = dir, sp[1][0], sp[1][1]
		var out bytes.Buffer
		resumed, err := run(&out, second)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var lines []string
		for l := range strings.Lines(out.String()) {
			if strings.HasPrefix(l, "resharded") {
				lines = append(lines, l)
			}
		}
		want := regexp.MustCompile(fmt.Sprintf(`^resharded the checkpoint of step 4: World %d → %d, [1-4] parameters placed anew\n$`, sp[0][0], sp[1][0]))
		got := strings.Join(lines, "")
		if sp[0] == sp[1] && got != "" || sp[0] != sp[1] && !want.MatchString(got) {
			t.Fatalf("%s: the resume printed %q, want a line as %v", name, got, want)
		}
		worst := 0.0
		for st := range resumed.params {
			for p := range resumed.params[st] {
				for i, y := range resumed.params[st][p] {
					x := straight.params[4+st][p][i]
					if d := math.Abs(x - y); d > 1e-6 {
						t.Fatalf("%s: step %d: %s[%d] = %v resumed, %v uninterrupted", name, 4+st, tensorNames[p], i, y, x)
					} else {
						worst = max(worst, d)
					}
				}
			}
		}
		t.Logf("%s: %q; the parameters at most %.3g from the uninterrupted run's", name, strings.TrimSpace(got), worst)
	}
}

// TestResumeRefusals: a resume on other data (another seed or batch) or
// past -steps is refused, naming what to change.
func TestResumeRefusals(t *testing.T) {
	seed := testSeed(t)
	c := traced()
	c.seed, c.steps, c.save = seed, 4, t.TempDir()
	if _, err := run(nil, c); err != nil {
		t.Fatal(err)
	}
	c.save, c.resume, c.steps = "", c.save, 8
	for _, v := range []struct {
		change func(*config)
		want   string
	}{
		{func(c *config) { c.seed++ }, fmt.Sprintf("resume with those (this run has -seed %d, -batch 24 (the default), -in 4 (the default))", seed+1)},
		{func(c *config) { c.batch = 48 }, "-batch 24"},
		{func(c *config) { c.steps = 3 }, "give at least 4"},
	} {
		bad := c
		v.change(&bad)
		if _, err := run(nil, bad); err == nil || !strings.Contains(err.Error(), v.want) {
			t.Errorf("got %v, want an error saying %q", err, v.want)
		}
	}
}

// TestMessagesMarkDefaults: a batch that does not split names each value
// with where it came from: a flag the command line set, one left at its
// default (marked so), or the DeepSpeed config.
func TestMessagesMarkDefaults(t *testing.T) {
	for _, v := range []struct {
		edit func(*config)
		want string
	}{
		{func(c *config) { c.accum, c.given = 5, map[string]bool{"accum": true} },
			"-batch 24 (the default) does not split into -world 2 (the default) ranks × -accum 5 micro-batches; give a -batch that is a multiple of 10"},
		{func(c *config) { c.batch, c.accum, c.given = 30, 4, map[string]bool{"batch": true, "accum": true} },
			"-batch 30 does not split into -world 2 (the default) ranks × -accum 4 micro-batches; give a -batch that is a multiple of 8"},
		{func(c *config) {
			c.deepspeed = writeConfig(t, `{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 5}`)
		}, "-batch 24 (the default) does not split into -world 2 (the default) ranks × 5 micro-batches, which fill the DeepSpeed config's \"auto\" batch sizes"},
	} {
		c := defaultConfig()
		v.edit(&c)
		if _, err := run(nil, c); err == nil || !strings.Contains(err.Error(), v.want) {
			t.Errorf("%v, want %q", err, v.want)
		}
	}
}

// TestResumeNewRate: -lr and -wd given with -resume hold from the resumed
// step on, the moments kept: the first resumed step's AdamW direction u
// (from the uninterrupted run, θ' = θ(1 − lr·wd) − lr·u) is the same, so
// θ' = θ(1 − lr₂·wd₂) − lr₂·u, to fp32's rounding of θ.
func TestResumeNewRate(t *testing.T) {
	seed := testSeed(t)
	c := traced()
	c.seed, c.steps = seed, 6
	straight, err := run(nil, c)
	if err != nil {
		t.Fatal(err)
	}
	first := c
	first.steps, first.save = 3, t.TempDir()
	if _, err := run(nil, first); err != nil {
		t.Fatal(err)
	}
	second := c
	second.resume, second.lr, second.weightDecay = first.save, 0.003, 0.2
	resumed, err := run(nil, second)
	if err != nil {
		t.Fatal(err)
	}
	before, after, got := straight.params[3], straight.params[4], resumed.params[1]
	for p := range before {
		wd, wd2 := 0.0, 0.0
		if tensorGroups[p] == 0 {
			wd, wd2 = c.weightDecay, second.weightDecay
		}
		for i, th := range before[p] {
			u := (th*(1-c.lr*wd) - after[p][i]) / c.lr
			want := th*(1-second.lr*wd2) - second.lr*u
			// fp32 rounds θ and the two results: 2^-24 of each, over lr
			tol := 0x1p-22 * (math.Abs(th) + math.Abs(after[p][i]) + math.Abs(want)) * (1 + second.lr/c.lr)
			if d := math.Abs(got[p][i] - want); !(d <= tol) {
				t.Fatalf("%s[%d] after the resumed step: %.9g, want %.9g (|diff| %.3g > %.3g)", tensorNames[p], i, got[p][i], want, d, tol)
			}
		}
	}
}

// TestFP16Conversion: fromFP16 against binary16's definition, evaluated in
// float64, for every bit pattern; fp16 returns each value's own pattern,
// and rounds the midpoint of each two neighbours to the even one and the
// float32 on either side of it to the nearer one; past 65504 it overflows
// to infinity at 65520 (the midpoint to 2^16).
func TestFP16Conversion(t *testing.T) {
	value := func(h uint16) float64 {
		e, m := int(h>>10&0x1f), float64(h&0x3ff)
		v := math.Ldexp(m, -24) // subnormal
		switch {
		case e == 0x1f && m == 0:
			v = math.Inf(1)
		case e == 0x1f:
			v = math.NaN()
		case e > 0:
			v = math.Ldexp(1024+m, e-25)
		}
		if h&0x8000 != 0 {
			v = -v
		}
		return v
	}
	for i := range 1 << 16 {
		h := uint16(i)
		want, got := value(h), float64(fromFP16(h))
		if math.IsNaN(want) {
			if !math.IsNaN(got) || fp16(float32(got))&0x7fff != 0x7e00 {
				t.Fatalf("%#04x: %v (fp16 %#04x), want a NaN", h, got, fp16(float32(got)))
			}
			continue
		}
		if got != want || math.Signbit(got) != math.Signbit(want) {
			t.Fatalf("fromFP16(%#04x) = %v, want %v", h, got, want)
		}
		if back := fp16(float32(want)); back != h {
			t.Fatalf("fp16(%v) = %#04x, want %#04x", want, back, h)
		}
	}
	for i := range 0x7bff { // each pair of positive finite neighbours, and their negatives
		for _, sign := range []uint16{0, 0x8000} {
			lo, hi := uint16(i)|sign, uint16(i+1)|sign
			mid := float32((value(lo) + value(hi)) / 2) // exact: 12 bits
			even := lo
			if i&1 == 1 {
				even = hi
			}
			below, above := math.Nextafter32(mid, float32(value(lo))), math.Nextafter32(mid, float32(value(hi)))
			if got := fp16(mid); got != even {
				t.Fatalf("fp16(%v), between %#04x and %#04x, = %#04x, want the even %#04x", mid, lo, hi, got, even)
			}
			if fp16(below) != lo || fp16(above) != hi {
				t.Fatalf("fp16 around %v: %#04x and %#04x, want %#04x and %#04x", mid, fp16(below), fp16(above), lo, hi)
			}
		}
	}
	for _, v := range []struct {
		f    float32
		want uint16
	}{{65519.996, 0x7bff}, {65520, 0x7c00}, {-65520, 0xfc00}, {1e9, 0x7c00}, {0x1p-25, 0}, {math.Nextafter32(0x1p-25, 1), 1}, {-0x1p-26, 0x8000}} {
		if got := fp16(v.f); got != v.want {
			t.Errorf("fp16(%v) = %#04x, want %#04x", v.f, got, v.want)
		}
	}
}

// TestFP16LossScaling: -fp16 hands over the gradients of the loss times
// the engine's scale. Recomputed in float64 at the run's parameters, each
// step must be skipped exactly when some micro-batch's gradient times the
// step's scale passes fp16's range (65520 rounds to infinity), a skipped
// step must leave the parameters' bits alone, and a taken step's
// (unscaled) gradient norm must be the global batch's within fp16's
// rounding. With DeepSpeed's defaults (2^16) the first steps overflow.
func TestFP16LossScaling(t *testing.T) {
	seed := testSeed(t)
	c := traced()
	c.seed, c.dtype, c.steps, c.accum = seed, zero.FP16, 12, 2
	res, err := run(nil, c)
	if err != nil {
		t.Fatal(err)
	}
	data := makeData(c)
	ref := newReference(c, res.params[0])
	taken, skipped, worst := 0, 0, 0.0
	for st, s := range res.stats {
		gs := ref.grads(res.params[st], data, st)
		// the scale is a power of two: x·S is exactly the trainer's value
		over := false
		for _, g := range gs {
			for p := range g {
				for _, x := range g[p] {
					over = over || math.Abs(x*s.LossScale) >= 65520
				}
			}
		}
		if s.Skipped != over {
			t.Fatalf("step %d at scale %g: skipped %v, but the scaled gradients overflow fp16: %v", st+1, s.LossScale, s.Skipped, over)
		}
		if s.Skipped {
			skipped++
			sameParams(t, fmt.Sprintf("step %d, skipped", st+1), result{params: res.params[st+1 : st+2]}, result{params: res.params[st : st+1]})
			continue
		}
		taken++
		norm := 0.0
		for _, g := range mean(gs) {
			for _, x := range g {
				norm += x * x
			}
		}
		norm = math.Sqrt(norm)
		d := math.Abs(s.GradNorm-norm) / norm
		if d > 2e-3 {
			t.Fatalf("step %d at scale %g: gradient norm %g, float64 %g: relative difference %.2g", st+1, s.LossScale, s.GradNorm, norm, d)
		}
		worst = max(worst, d)
	}
	if taken == 0 || skipped == 0 {
		t.Fatalf("%d steps taken, %d skipped: the test needs both (scales %v)", taken, skipped, scales(res))
	}
	t.Logf("%d steps skipped, %d taken, the norm within %.2g of float64's; scales %v", skipped, taken, worst, scales(res))
}

// BenchmarkTrainStep: one training step of a wider MLP (32→4096→1, 2 ranks,
// global batch 16, 64 KiB buckets) at stage 2 and at stage 3 with and
// without prefetch, and the share of it that the optimizer pass and the
// parameters' gathers take, from the engine's stats. At stage 3, hidden is
// the share of the gathers' time the forward and backward did not wait for.
// With offload, the copies of the gradients to the host (and the share of
// them that backward hid), the copies of the new parameters back, and the
// host and device bytes.
func BenchmarkTrainStep(b *testing.B) {
	for _, v := range []struct {
		name            string
		stage, prefetch int
		offload         bool
	}{{"zero2", 2, 0, false}, {"zero2/offload", 2, 0, true}, {"zero3/prefetch", 3, 0, false}, {"zero3/prefetch/offload", 3, 0, true}, {"zero3/no-prefetch", 3, -1, false}} {
		b.Run(v.name, func(b *testing.B) {
			c := traced()
			c.in, c.hidden, c.batch, c.steps, c.bucketBytes = 32, 4096, 16, b.N+1, 64<<10
			c.stage, c.prefetchBytes, c.offload = v.stage, v.prefetch, v.offload
			res, err := run(nil, c)
			if err != nil {
				b.Fatal(err)
			}
			var wall, opt, gather, waited, gradCopy, exposed, paramCopy time.Duration
			for st := 1; st < len(res.wall); st++ { // the first step allocates the moments
				wall += res.wall[st]
				opt += res.stats[st].OptimizerTime
				gather += res.stats[st].ParamGatherTime
				waited += res.waited[st]
				gradCopy += res.stats[st].GradCopyTime
				exposed += res.stats[st].GradCopyExposed
				paramCopy += res.stats[st].ParamCopyTime
			}
			n := float64(len(res.wall) - 1)
			b.ReportMetric(wall.Seconds()*1e3/n, "step_ms")
			b.ReportMetric(opt.Seconds()*1e3/n, "optimizer_ms")
			b.ReportMetric(gather.Seconds()*1e3/n, "gather_ms")
			b.ReportMetric(float64(opt)/float64(wall), "optimizer_share")
			if v.stage == 3 {
				b.ReportMetric(waited.Seconds()*1e3/n, "waited_ms")
				b.ReportMetric(1-float64(waited)/float64(gather), "hidden")
			}
			if v.offload {
				last := res.stats[len(res.stats)-1]
				b.ReportMetric(gradCopy.Seconds()*1e3/n, "grad_copy_ms")
				b.ReportMetric(1-float64(exposed)/float64(gradCopy), "copy_hidden")
				b.ReportMetric(paramCopy.Seconds()*1e3/n, "param_copy_ms")
				b.ReportMetric(float64(last.HostBytes)/(1<<20), "host_MiB")
				b.ReportMetric(float64(last.DeviceBytesSaved)/(1<<20), "saved_MiB")
			}
		})
	}
}

// readExport reads a safetensors file as the format's description says:
// the 8-byte header length, the JSON header, and each tensor's fp32
// values from its data offsets.
func readExport(t *testing.T, path string) (map[string][]int, map[string][]float32, map[string]string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(b)
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &hdr); err != nil {
		t.Fatal(err)
	}
	shapes, values, meta := map[string][]int{}, map[string][]float32{}, map[string]string{}
	for name, raw := range hdr {
		if name == "__metadata__" {
			json.Unmarshal(raw, &meta)
			continue
		}
		var e struct {
			DType   string `json:"dtype"`
			Shape   []int  `json:"shape"`
			Offsets [2]int `json:"data_offsets"`
		}
		if err := json.Unmarshal(raw, &e); err != nil || e.DType != "F32" {
			t.Fatalf("%s: tensor %q: %s %v", path, name, e.DType, err)
		}
		data := b[8+int(n)+e.Offsets[0] : 8+int(n)+e.Offsets[1]]
		x := make([]float32, len(data)/4)
		for i := range x {
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
		}
		shapes[name], values[name] = e.Shape, x
	}
	return shapes, values, meta
}

// TestExport: -export writes the fp32 parameters as one safetensors file,
// each tensor by name with its shape: in fp32 bit for bit the trained
// parameters, with bf16 parameters (stage 3, offload) their fp32 master,
// which rounds (to nearest even) to the parameters and is not them; a run
// resumed from a checkpoint writes the file the run that never stopped
// writes, byte for byte.
func TestExport(t *testing.T) {
	seed := testSeed(t)
	for _, tc := range []struct {
		dt      zero.DType
		stage   int
		offload bool
	}{{zero.FP32, 2, false}, {zero.BF16, 3, true}, {zero.FP32, 1, true}} {
		dir := t.TempDir()
		c := traced()
		c.seed, c.dtype, c.stage, c.offload, c.steps, c.world = seed, tc.dt, tc.stage, tc.offload, 6, 3
		c.export = filepath.Join(dir, "straight.safetensors")
		var out bytes.Buffer
		res, err := run(&out, c)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), "fp32 parameters exported to "+c.export) {
			t.Fatalf("the run does not say where it exported:\n%s", out.String())
		}
		shapes, values, meta := readExport(t, c.export)
		m := mlp{c.in, c.hidden}
		if len(values) != 4 || meta["format"] != "pt" || meta["zero.step"] != "6" {
			t.Fatalf("%v: %d tensors, metadata %v", tc.dt, len(values), meta)
		}
		last := res.params[len(res.params)-1]
		differs := false
		for p, name := range tensorNames {
			if !slices.Equal(shapes[name], m.shapes()[p]) {
				t.Fatalf("%s: shape %v, want %v", name, shapes[name], m.shapes()[p])
			}
			for i, x := range values[name] {
				got := float64(x)
				if tc.dt == zero.BF16 {
					got = float64(math.Float32frombits(uint32(bf16(x)) << 16))
					differs = differs || got != float64(x)
				}
				if math.Float64bits(got) != math.Float64bits(last[p][i]) {
					t.Fatalf("%v: %s[%d]: the export holds %v, which is not the parameter %v", tc.dt, name, i, x, last[p][i])
				}
			}
		}
		if tc.dt == zero.BF16 && !differs {
			t.Fatal("bf16: the export equals the rounded parameters: it is not the master, or the test cannot tell")
		}
		// stopped after 3 steps, resumed, exported
		first, resumed := c, c
		first.steps, first.export, first.save = 3, "", filepath.Join(dir, "ckpt")
		if _, err := run(nil, first); err != nil {
			t.Fatal(err)
		}
		resumed.resume, resumed.export = first.save, filepath.Join(dir, "resumed.safetensors")
		if _, err := run(nil, resumed); err != nil {
			t.Fatal(err)
		}
		a, _ := os.ReadFile(c.export)
		b, _ := os.ReadFile(resumed.export)
		if !bytes.Equal(a, b) {
			t.Fatalf("%v: the resumed run's export differs from the uninterrupted run's", tc.dt)
		}
	}
}

// TestRunKeepsNoHistory: without trace a run keeps what its end prints (a
// loss, a scale and a flag per step), not every step's parameters, stats
// and times, and prints what the traced run prints, at every stage and in
// fp16 (whose lines show the scale and the skips).
func TestRunKeepsNoHistory(t *testing.T) {
	for _, stage := range []int{1, 2, 3} {
		c := defaultConfig()
		c.stage, c.steps, c.dtype = stage, 12, zero.FP16
		c.lossScale = zero.LossScale{Initial: 1 << 20, Window: 2} // a few steps overflow and are skipped
		var plain, full bytes.Buffer
		res, err := run(&plain, c)
		if err != nil {
			t.Fatal(err)
		}
		if res.params != nil || res.stats != nil || res.wall != nil || res.waited != nil {
			t.Errorf("stage %d: %d parameter snapshots, %d stats, %d walls, %d waits kept without trace",
				stage, len(res.params), len(res.stats), len(res.wall), len(res.waited))
		}
		if len(res.loss) != c.steps || len(res.scale) != c.steps || len(res.skip) != c.steps {
			t.Errorf("stage %d: %d losses, %d scales, %d skips for %d steps", stage, len(res.loss), len(res.scale), len(res.skip), c.steps)
		}
		c.trace = true
		if _, err := run(&full, c); err != nil {
			t.Fatal(err)
		}
		if a, b := throughput.ReplaceAllString(plain.String(), "N samples/s"), throughput.ReplaceAllString(full.String(), "N samples/s"); a != b {
			t.Errorf("stage %d: the run without trace printed\n%s\nthe traced run\n%s", stage, plain.String(), full.String())
		}
		if !strings.Contains(plain.String(), "skipped: overflow") {
			t.Errorf("stage %d: no step skipped; the case does not show the skips\n%s", stage, plain.String())
		}
	}
}

// BenchmarkRunHistory: the bytes a run still holds per step when it
// ends (its result, measured on the Go heap after a collection), with and
// without trace, for a 17k-parameter MLP (in 64, hidden 256): what a long
// run's memory grows by per step.
func BenchmarkRunHistory(b *testing.B) {
	for _, trace := range []bool{false, true} {
		b.Run(fmt.Sprintf("trace=%v", trace), func(b *testing.B) {
			c := defaultConfig()
			c.in, c.hidden, c.steps, c.trace = 64, 256, b.N, trace
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			res, err := run(nil, c)
			if err != nil {
				b.Fatal(err)
			}
			runtime.GC()
			runtime.ReadMemStats(&after)
			kept := int64(after.HeapAlloc) - int64(before.HeapAlloc)
			b.ReportMetric(float64(kept)/float64(c.steps), "kept_B/step")
			runtime.KeepAlive(res)
		})
	}
}
