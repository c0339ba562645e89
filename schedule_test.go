package zero

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// ---- DeepSpeed's schedulers as DeepSpeed runs them -------------------------------
//
// Each sim below is written the way deepspeed/runtime/lr_schedules.py is: an
// object built with last_batch_iteration −1 that sets the group's settings
// when built, and a step() that the engine calls after every optimizer step
// it applies (engine._take_model_step skips it on overflow). The settings a
// step runs with are the group's at the time. PyTorch's LambdaLR is built by
// stepping once (last_epoch 0).

// simGroup is a parameter group's settings as a torch optimizer holds them.
type simGroup struct {
	lr, beta1, beta2 float64
}

type dsSim interface {
	step(g *simGroup)
}

// simWarmup is WarmupLR (total < 0) and WarmupDecayLR.
type simWarmup struct {
	minLR, deltaLR float64
	n              int
	linear         bool
	total          int
	invLog         float64
	last           int
}

func newSimWarmup(g *simGroup, minLR, maxLR float64, n int, linear bool, total int) *simWarmup {
	s := &simWarmup{minLR: minLR, deltaLR: maxLR - minLR, n: max(2, n), linear: linear, total: total, last: -1}
	s.invLog = 1.0 / math.Log(float64(s.n))
	g.lr = s.getLR()
	return s
}

func (s *simWarmup) gamma() float64 {
	if s.last < s.n {
		if s.linear {
			return float64(s.last) / float64(s.n)
		}
		return s.invLog * math.Log(float64(s.last+1))
	}
	if s.total < 0 {
		return 1
	}
	return math.Max(0, float64(s.total-s.last)/math.Max(1, float64(s.total-s.n)))
}

func (s *simWarmup) getLR() float64 {
	if s.last < 0 {
		return s.minLR
	}
	return s.minLR + s.deltaLR*s.gamma()
}

func (s *simWarmup) step(g *simGroup) { s.last++; g.lr = s.getLR() }

// simCosine is WarmupCosineLR.
type simCosine struct {
	total, n         int
	minRatio, cosMin float64
	linear           bool
	orgLR, invLog    float64
	last             int
}

func newSimCosine(g *simGroup, total int, minRatio float64, n int, cosMin float64, linear bool) *simCosine {
	s := &simCosine{total: total, minRatio: minRatio, n: max(2, n), cosMin: cosMin, linear: linear, orgLR: g.lr, last: -1}
	s.invLog = 1.0 / math.Log(float64(s.n))
	g.lr = s.getLR()
	return s
}

func (s *simCosine) ratio() float64 {
	if s.last < s.n {
		r := float64(s.last) / float64(s.n)
		if !s.linear {
			r = s.invLog * math.Log(float64(s.last+1))
		}
		return s.minRatio + r*(1.-s.minRatio)
	}
	realLast := s.last - s.n + 1
	realTotal := max(1, s.total-s.n)
	progress := math.Min(1.0, float64(realLast)/float64(realTotal))
	r := (1 + math.Cos(math.Pi*progress)) / 2
	return math.Max(0.0, s.cosMin+(1.-s.cosMin)*r)
}

func (s *simCosine) getLR() float64 {
	if s.last < 0 {
		return 0
	}
	return s.orgLR * s.ratio()
}

func (s *simCosine) step(g *simGroup) { s.last++; g.lr = s.getLR() }

// simOneCycle is OneCycle, with its momentum cycle on Adam's betas.
type simOneCycle struct {
	totalSize, stepRatio, first, second float64
	firstStairs, secondStairs           int
	decayStep                           float64
	skipLRDecay, skipMomDecay           bool
	minLR, maxLR, decayLRRate           float64
	minMom, maxMom, decayMomRate        float64
	cycleMomentum                       bool
	last                                int
}

func newSimOneCycle(g *simGroup, c OneCycle) *simOneCycle {
	s := &simOneCycle{first: float64(c.FirstStepSize), second: float64(c.SecondStepSize),
		firstStairs: c.FirstStairCount, secondStairs: c.SecondStairCount, decayStep: float64(c.DecayStepSize),
		minLR: c.MinLR, maxLR: c.MaxLR, decayLRRate: c.DecayLRRate, minMom: c.MinMom, maxMom: c.MaxMom,
		decayMomRate: c.DecayMomRate, cycleMomentum: c.CycleMomentum, last: -1}
	s.totalSize = s.first + s.second
	s.stepRatio = s.first / s.totalSize
	s.skipLRDecay = s.decayStep == 0 || s.decayLRRate == 0
	s.skipMomDecay = s.decayStep == 0 || s.decayMomRate == 0
	g.lr = s.minLR
	if s.cycleMomentum {
		g.beta1, g.beta2 = s.minMom, 0.99
	}
	return s
}

func (s *simOneCycle) scaleFactor() float64 {
	b := float64(s.last + 1)
	cycle := math.Floor(1 + b/s.totalSize)
	x := 1. + b/s.totalSize - cycle
	var f float64
	stairs := s.firstStairs
	if x <= s.stepRatio {
		f = x / s.stepRatio
	} else {
		f = (x - 1) / (s.stepRatio - 1)
		stairs = s.secondStairs
	}
	if stairs > 0 {
		ci := math.Mod(b, s.totalSize)
		var pos float64
		if ci <= s.first {
			pos = ci * float64(stairs) / s.first
		} else {
			pos = (s.totalSize - ci) * float64(stairs) / s.second
		}
		f = math.Floor(pos) / float64(stairs)
	}
	return f
}

func (s *simOneCycle) step(g *simGroup) {
	s.last++
	if float64(s.last) < s.totalSize {
		f := s.scaleFactor()
		g.lr = s.minLR + (s.maxLR-s.minLR)*f
		if s.cycleMomentum {
			g.beta1 = s.maxMom - (s.maxMom-s.minMom)*f
		}
		return
	}
	d := float64(s.last) - s.totalSize + 1
	g.lr = s.minLR
	if !s.skipLRDecay {
		g.lr = s.minLR / (1 + s.decayLRRate*(d/s.decayStep))
	}
	if s.cycleMomentum {
		g.beta1 = s.maxMom
		if !s.skipMomDecay {
			g.beta1 = s.maxMom * (1 + s.decayMomRate*(d/s.decayStep))
		}
	}
}

// simLambda is torch's LambdaLR over the Hugging Face Trainer's lambdas.
type simLambda struct {
	base   float64
	lambda func(int) float64
	epoch  int
}

func newSimLambda(g *simGroup, lambda func(int) float64) *simLambda {
	s := &simLambda{base: g.lr, lambda: lambda}
	g.lr = s.base * lambda(0)
	return s
}

func (s *simLambda) step(g *simGroup) { s.epoch++; g.lr = s.base * s.lambda(s.epoch) }

func hfLinear(warmup, total int) func(int) float64 {
	return func(step int) float64 {
		if step < warmup {
			return float64(step) / float64(max(1, warmup))
		}
		return math.Max(0.0, float64(total-step)/float64(max(1, total-warmup)))
	}
}

func hfCosine(warmup, total int, cycles float64) func(int) float64 {
	return func(step int) float64 {
		if step < warmup {
			return float64(step) / float64(max(1, warmup))
		}
		progress := float64(step-warmup) / float64(max(1, total-warmup))
		return math.Max(0.0, 0.5*(1.0+math.Cos(math.Pi*cycles*2.0*progress)))
	}
}

// scheduleCase is a zero schedule beside the DeepSpeed (or PyTorch) object
// that must give the same settings.
type scheduleCase struct {
	name  string
	sched Schedule
	sim   func(g *simGroup) dsSim
}

func scheduleCases() []scheduleCase {
	with := func(s WarmupLR, edit func(*WarmupLR)) WarmupLR { edit(&s); return s }
	oc := func(edit func(*OneCycle)) OneCycle { c := NewOneCycle(0.0001, 0.001); edit(&c); return c }
	stairs := oc(func(c *OneCycle) {
		c.FirstStepSize, c.SecondStepSize, c.FirstStairCount, c.SecondStairCount = 10, 6, 4, 3
		c.DecayStepSize, c.DecayLRRate, c.DecayMomRate = 3, 0.5, 0.01
	})
	smooth := oc(func(c *OneCycle) { c.FirstStepSize, c.SecondStepSize, c.DecayStepSize, c.DecayLRRate = 7, 7, 2, 0.1 })
	noMom := oc(func(c *OneCycle) { c.FirstStepSize, c.SecondStepSize, c.CycleMomentum = 5, 0, false })
	var cases []scheduleCase
	for _, n := range []int{1, 2, 5} {
		for _, linear := range []bool{false, true} {
			w := WarmupLog
			if linear {
				w = WarmupLinear
			}
			cases = append(cases,
				scheduleCase{fmt.Sprintf("WarmupLR n=%d %v", n, w), with(NewWarmupLR(0.001, 0.01, n), func(s *WarmupLR) { s.Warmup = w }),
					func(g *simGroup) dsSim { return newSimWarmup(g, 0.001, 0.01, n, linear, -1) }},
				scheduleCase{fmt.Sprintf("WarmupDecayLR n=%d %v", n, w), WarmupDecayLR{TotalSteps: 9, MinLR: 0, MaxLR: 0.02, WarmupSteps: n, Warmup: w, set: true},
					func(g *simGroup) dsSim { return newSimWarmup(g, 0, 0.02, n, linear, 9) }},
				scheduleCase{fmt.Sprintf("WarmupCosineLR n=%d %v", n, w), WarmupCosineLR{TotalSteps: 11, WarmupMinRatio: 0.1, WarmupSteps: n, CosMinRatio: 0.05, Warmup: w, set: true},
					func(g *simGroup) dsSim { return newSimCosine(g, 11, 0.1, n, 0.05, linear) }})
		}
	}
	groupMax := NewWarmupLR(0.0005, 0, 4)
	groupMax.GroupMaxLR = true
	cases = append(cases,
		scheduleCase{"WarmupLR to the group's rate", groupMax, func(g *simGroup) dsSim { return newSimWarmup(g, 0.0005, g.lr, 4, false, -1) }},
		scheduleCase{"WarmupCosineLR defaults", NewWarmupCosine(4, 12), func(g *simGroup) dsSim { return newSimCosine(g, 12, 0, 4, 0.0001, false) }},
		scheduleCase{"OneCycle stairs and decay", stairs, func(g *simGroup) dsSim { return newSimOneCycle(g, stairs) }},
		scheduleCase{"OneCycle smooth", smooth, func(g *simGroup) dsSim { return newSimOneCycle(g, smooth) }},
		scheduleCase{"OneCycle no momentum, no second half", noMom, func(g *simGroup) dsSim { return newSimOneCycle(g, noMom) }},
		scheduleCase{"LinearWarmup", NewLinearWarmup(3, 10), func(g *simGroup) dsSim { return newSimLambda(g, hfLinear(3, 10)) }},
		scheduleCase{"LinearWarmup no warmup", NewLinearWarmup(0, 4), func(g *simGroup) dsSim { return newSimLambda(g, hfLinear(0, 4)) }},
		scheduleCase{"CosineWarmup", NewCosineWarmup(3, 10), func(g *simGroup) dsSim { return newSimLambda(g, hfCosine(3, 10, 0.5)) }},
		scheduleCase{"CosineWarmup 1.5 periods", CosineWarmup{WarmupSteps: 2, TotalSteps: 9, Cycles: 1.5, set: true},
			func(g *simGroup) dsSim { return newSimLambda(g, hfCosine(2, 9, 1.5)) }},
	)
	return cases
}

// TestSchedulesFollowDeepSpeed: for every schedule, the settings At gives
// for the t-th applied step are those DeepSpeed's scheduler object (or
// PyTorch's LambdaLR) leaves in the group when that step runs, over the
// warmup boundary, the cycle's halves, the decay and past the end, with
// some optimizer steps skipped (which step no scheduler).
func TestSchedulesFollowDeepSpeed(t *testing.T) {
	skipped := map[int]bool{2: true, 3: true, 9: true}
	for _, c := range scheduleCases() {
		for _, kind := range []Optimizer{NewAdamW(0.003), NewSGD(0.003)} {
			base := kind
			g := &simGroup{lr: optLR(base), beta1: 0.9, beta2: 0.999}
			sim := c.sim(g)
			applied := 0
			for call := range 30 {
				if skipped[call] {
					continue // overflow: no scheduler step, no t
				}
				got := c.sched.At(applied, base)
				what := fmt.Sprintf("%s, %T, step %d (%d applied before)", c.name, base, call, applied)
				schedFloat(t, what+" lr", optLR(got), g.lr)
				oc, cycles := c.sched.(OneCycle)
				switch o := got.(type) {
				case AdamW:
					wantB1, wantB2 := 0.9, 0.999
					if cycles && oc.CycleMomentum {
						wantB1 = g.beta1 // zero leaves beta2 to the group (ReadDeepSpeed sets 0.99)
					}
					schedFloat(t, what+" beta1", o.Beta1, wantB1)
					schedFloat(t, what+" beta2", o.Beta2, wantB2)
				case SGD:
					want := 0.0
					if cycles && oc.CycleMomentum {
						want = g.beta1
					}
					schedFloat(t, what+" momentum", o.Momentum, want)
				}
				sim.step(g)
				applied++
			}
		}
	}
}

// schedFloat: got equals want within 4 ulps (the order of operations is
// DeepSpeed's on both sides; the margin is for the compiler's fused
// multiply-adds).
func schedFloat(t *testing.T, what string, got, want float64) {
	t.Helper()
	if got == want || math.Abs(got-want) <= 4*math.Abs(want)*0x1p-52 {
		return
	}
	t.Errorf("%s: %.17g, want %.17g", what, got, want)
}

// TestScheduleSteppedByTheEngine: an engine with DeepSpeed's WarmupDecayLR
// runs each applied step at the rate DeepSpeed's scheduler gives, and
// reports it in Stats.LR; a step skipped on overflow advances nothing (its
// Stats.LR is the rate the next step uses); OneCycle's momentum cycle
// reaches AdamW's first moment. SGD and AdamW in float64 are the reference.
func TestScheduleSteppedByTheEngine(t *testing.T) {
	const g0 = 0.25
	sizes := []int{130, 5}
	skip := 2
	grad := func(st, k, rank, p, j int) float64 {
		if st == skip && rank == 1 && p == 0 && j == 7 {
			return math.Inf(1)
		}
		return g0 * float64(1+j%3)
	}
	init := func(p, j int) float32 { return 1 }
	t.Run("WarmupDecayLR on SGD", func(t *testing.T) {
		sched := NewWarmupDecay(0.01, 0.5, 3, 6)
		sched.Warmup = WarmupLinear
		tr := runOpt(t, optCase{cfg: Config{Stage: 2, BucketBytes: 256, Align: 1, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(1)}, Schedule: sched}},
			sizes: sizes, dt: FP32, init: init, backwards: 1, steps: 8, grad: grad})
		g := &simGroup{lr: 1}
		sim := newSimWarmup(g, 0.01, 0.5, 3, true, 6)
		want := 1.0
		for st := range 8 {
			for r := range tr.stats {
				if lr := tr.stats[r][st].LR; len(lr) != 1 || lr[0] != g.lr {
					t.Fatalf("step %d rank %d: Stats.LR %v, want [%v] (DeepSpeed's rate for the step; a skip repeats it)", st, r, lr, g.lr)
				}
			}
			if st == skip {
				if !tr.stats[0][st].Skipped {
					t.Fatalf("step %d did not skip", st)
				}
			} else {
				want -= g.lr * g0 * 2 // element 1: gradient 2·g0 on both ranks
				sim.step(g)
			}
			closeTo(t, fmt.Sprintf("step %d", st), tr.master[st][0][1], want, 1e-6, 1e-7)
		}
	})
	t.Run("OneCycle on AdamW", func(t *testing.T) {
		sched := NewOneCycle(0.01, 0.1)
		sched.FirstStepSize, sched.SecondStepSize, sched.MinMom, sched.MaxMom = 2, 3, 0.5, 0.95
		adam := NewAdamW(1)
		tr := runOpt(t, optCase{cfg: Config{Stage: 2, BucketBytes: 256, Align: 1, Optimizer: OptimizerPolicy{Groups: []Optimizer{adam}, Schedule: sched}},
			sizes: sizes, dt: FP32, init: init, backwards: 1, steps: 7, grad: grad})
		g := &simGroup{lr: 1, beta1: 0.9, beta2: 0.999}
		sim := newSimOneCycle(g, sched)
		p, m, v := 1.0, 0.0, 0.0
		applied := 0
		for st := range 7 {
			if lr := tr.stats[0][st].LR; len(lr) != 1 || math.Abs(lr[0]-g.lr) > 1e-15*g.lr {
				t.Fatalf("step %d: Stats.LR %v, want [%v]", st, lr, g.lr)
			}
			if st != skip {
				applied++
				ref := refAdamW{lr: g.lr, b1: g.beta1, b2: 0.999, eps: 1e-8}
				ref.step(&p, &m, &v, g0*2, applied)
				sim.step(g)
			}
			closeTo(t, fmt.Sprintf("step %d", st), tr.master[st][0][1], p, 1e-5, 1e-6)
		}
	})
}

// TestScheduleResumes: a run saved after 3 steps and loaded into fresh
// engines with the same schedule goes on as the run that never stopped,
// bit for bit: t is in the checkpoint, the rest in the settings.
func TestScheduleResumes(t *testing.T) {
	sched := NewWarmupDecay(0.001, 0.3, 3, 7)
	cfg := Config{Stage: 2, BucketBytes: 256, Align: 1, Params: ParamPolicy{NoBroadcast: true},
		Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(1)}, Schedule: sched}}
	sizes := []int{70, 9}
	dir := t.TempDir()
	run := func(from, to int, load, save bool) []float32 {
		out := make([][]float32, 2)
		comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
		errs := eachRank(2, func(rank int) error {
			ps := make([]Param, len(sizes))
			for p, n := range sizes {
				b := newTBuf(FP32, n)
				for j := range n {
					b.set(j, 1)
				}
				ps[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: FP32, Data: b.t()}
			}
			e, err := New(cfg, comms[rank], ps)
			if err != nil {
				return err
			}
			defer e.Close()
			if load {
				if _, err := e.Load(dir, LoadOptions{}); err != nil {
					return err
				}
			}
			s := NewHostStream()
			defer s.Close()
			for st := from; st < to; st++ {
				for p := len(ps) - 1; p >= 0; p-- {
					g := newTBuf(FP32, ps[p].Count)
					for j := range g.len() {
						g.set(j, float32(0.1*float64(1+st+j%5+rank)))
					}
					if _, err := e.GradReady(p, g.t(), s); err != nil {
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
			if save {
				if err := e.Save(dir, SaveOptions{}); err != nil {
					return err
				}
			}
			full, err := e.FullParams()
			if err != nil {
				return err
			}
			out[rank] = full[0]
			return nil
		})
		everyRankIs(t, "schedule run", errs, nil)
		return out[0]
	}
	whole := run(0, 6, false, false)
	run(0, 3, false, true)
	resumed := run(3, 6, true, false)
	for i := range whole {
		if math.Float32bits(whole[i]) != math.Float32bits(resumed[i]) {
			t.Fatalf("element %d: resumed %v, uninterrupted %v", i, resumed[i], whole[i])
		}
	}
}

// TestScheduleChecks: a schedule literal, or one with a setting out of
// range, is refused at New with ErrConfig naming it, before any
// collective; every field of every schedule carries a class and is in
// the settings record, and ranks whose schedules differ get
// ErrPlanMismatch naming the field.
func TestScheduleChecks(t *testing.T) {
	bad := map[string]Schedule{
		"WarmupLR literal":            WarmupLR{MaxLR: 1, WarmupSteps: 5},
		"WarmupDecayLR literal":       WarmupDecayLR{TotalSteps: 5},
		"WarmupCosineLR literal":      WarmupCosineLR{},
		"OneCycle literal":            OneCycle{MinLR: 1},
		"LinearWarmup literal":        LinearWarmup{},
		"CosineWarmup literal":        CosineWarmup{},
		"WarmupLR 0 steps":            NewWarmupLR(0, 1, 0),
		"WarmupLR max and group max":  WarmupLR{MaxLR: 1, WarmupSteps: 3, GroupMaxLR: true, set: true},
		"WarmupLR warmup type":        WarmupLR{MaxLR: 1, WarmupSteps: 3, Warmup: 7, set: true},
		"WarmupDecayLR negative":      NewWarmupDecay(0, 1, 3, -1),
		"WarmupCosineLR NaN":          WarmupCosineLR{TotalSteps: 4, WarmupSteps: 2, CosMinRatio: math.NaN(), set: true},
		"OneCycle first half 0":       OneCycle{MinLR: 0, MaxLR: 1, set: true},
		"OneCycle negative momentum":  OneCycle{MinLR: 0, MaxLR: 1, FirstStepSize: 3, CycleMomentum: true, MinMom: -1, set: true},
		"LinearWarmup negative":       NewLinearWarmup(-1, 3),
		"CosineWarmup infinite cycle": CosineWarmup{WarmupSteps: 1, TotalSteps: 3, Cycles: math.Inf(1), set: true},
	}
	ps := []Param{{Name: "a", Count: 4, DType: FP32, Data: Float32s(make([]float32, 4))}}
	for name, s := range bad {
		comms, _ := NewLocalGroup(1)
		dev := newCountingDevice()
		c := &countingComm{Comm: onDevice{comms[0], dev}}
		_, err := New(Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.1)}, Schedule: s}}, c, ps)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "Optimizer.Schedule") {
			t.Errorf("%s: %v, want ErrConfig naming Optimizer.Schedule", name, err)
		}
		if c.calls != 0 || dev.allocs.Load() != 0 {
			t.Errorf("%s: refused after %d collectives and %d allocations", name, c.calls, dev.allocs.Load())
		}
	}
	// a momentum decay that takes beta1 to 1 fails the group's check at Step
	decay := NewOneCycle(0.01, 0.1)
	decay.FirstStepSize, decay.SecondStepSize, decay.DecayStepSize, decay.DecayMomRate = 1, 1, 1, 0.1
	errs := onEngines(1, 5*time.Second, Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.1)}, Schedule: decay}}, ps,
		func(e *Engine, s *HostStream) error {
			for st := 0; ; st++ {
				if _, err := e.GradReady(0, Float32s([]float32{1, 1, 1, 1}), s); err != nil {
					return err
				}
				if err := e.EndBackward(); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					if st < 2 {
						return fmt.Errorf("step %d failed early: %w", st, err)
					}
					return err
				}
				if st > 10 {
					return errors.New("beta1 passed 1 without an error")
				}
			}
		})
	if !errors.Is(errs[0], ErrConfig) || !strings.Contains(errs[0].Error(), "betas") {
		t.Errorf("a momentum decay past 1: %v, want ErrConfig naming the betas", errs[0])
	}

	for _, s := range []Schedule{WarmupLR{}, WarmupDecayLR{}, WarmupCosineLR{}, OneCycle{}, LinearWarmup{}, CosineWarmup{}} {
		rt := reflect.TypeOf(s)
		for i := range rt.NumField() {
			f := rt.Field(i)
			if !f.IsExported() {
				continue
			}
			if _, ok := classOf(f); !ok {
				t.Errorf("%s.%s has no class tag", rt.Name(), f.Name)
			}
		}
	}
	rec := settingsRecord(Config{Optimizer: OptimizerPolicy{Schedule: NewOneCycle(0.1, 1)}}, nil, 1)
	for _, want := range []string{"Optimizer.Schedule", "Optimizer.Schedule.MaxLR", "Optimizer.Schedule.CycleMomentum", "Optimizer.Schedule.DecayStepSize"} {
		found := false
		for _, s := range rec {
			found = found || s.Path == want && s.Class == ClassMatch
		}
		if !found {
			t.Errorf("the record has no %s of class match", want)
		}
	}
	// ranks with different warmups
	comms, _ := NewLocalGroupTimeout(2, 5*time.Second)
	errs = eachRank(2, func(r int) error {
		s := NewWarmupLR(0, 0.1, 10)
		if r == 1 {
			s.Warmup = WarmupLinear
		}
		e, err := New(Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.1)}, Schedule: s}}, comms[r], ps)
		if err == nil {
			e.Close()
		}
		return err
	})
	for r, err := range errs {
		if !errors.Is(err, ErrPlanMismatch) || !strings.Contains(err.Error(), "Optimizer.Schedule.Warmup: rank 0 has log, rank 1 has linear") {
			t.Errorf("rank %d: %v, want ErrPlanMismatch naming Optimizer.Schedule.Warmup", r, err)
		}
	}
}

// TestScheduleConstructorsOneOrder: every schedule constructor in
// schedule.go that is not deprecated takes the rates first, then the
// warmup steps, then the total steps (read from its parameter names), and
// each deprecated one builds what its replacement builds.
func TestScheduleConstructorsOneOrder(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "schedule.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	rank := map[string]int{"minLR": 0, "maxLR": 0, "warmup": 1, "steps": 1, "total": 2}
	checked := 0
	for _, d := range f.Decls {
		fn, ok := d.(*ast.FuncDecl)
		if !ok || fn.Recv != nil || !strings.HasPrefix(fn.Name.Name, "New") || strings.Contains(fn.Doc.Text(), "Deprecated:") {
			continue
		}
		last := -1
		for _, field := range fn.Type.Params.List {
			for _, name := range field.Names {
				r, known := rank[name.Name]
				if !known || r < last {
					t.Errorf("%s: parameter %s %s; want the rates, then the warmup, then the total", fn.Name.Name, name.Name,
						map[bool]string{true: "out of order", false: "of no known kind"}[known])
				}
				last = r
			}
		}
		checked++
	}
	if checked < 6 {
		t.Errorf("%d constructors checked, want the 6 schedules'", checked)
	}
	if a, b := NewWarmupDecayLR(100, 0.01, 0.5, 10), NewWarmupDecay(0.01, 0.5, 10, 100); !reflect.DeepEqual(a, b) {
		t.Errorf("NewWarmupDecayLR(total 100, …, warmup 10) = %+v, NewWarmupDecay %+v", a, b)
	}
	if a, b := NewWarmupCosineLR(100, 10), NewWarmupCosine(10, 100); !reflect.DeepEqual(a, b) {
		t.Errorf("NewWarmupCosineLR(total 100, warmup 10) = %+v, NewWarmupCosine %+v", a, b)
	}
}

// TestScheduleWarmupOutlastsTotal: a schedule built in Go whose warmup
// outlasts its total steps (DeepSpeed's counted as at least 2) is noticed
// by Engine.Notices, as ReadDeepSpeed notices the same settings of
// WarmupDecayLR and WarmupCosineLR at total_num_steps; one whose warmup
// fits is not. A JSON notice cites DeepSpeed's default warmup as such.
func TestScheduleWarmupOutlastsTotal(t *testing.T) {
	ps := []Param{{Name: "a", Count: 4, DType: FP32, Data: Float32s(make([]float32, 4))}}
	notices := func(s Schedule) []string {
		comms, _ := NewLocalGroup(1)
		e, err := New(Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.1)}, Schedule: s}}, comms[0], ps)
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		return e.Notices()
	}
	for _, c := range []struct{ warmup, total int }{{10, 5}, {5, 10}, {10, 10}, {1, 1}, {1, 2}, {0, 0}, {3, 0}} {
		for _, sc := range []struct {
			name     string
			s        Schedule
			dsWarmup bool // counted as at least 2
			json     string
		}{
			{"WarmupDecayLR", NewWarmupDecay(0, 0.1, c.warmup, c.total), true, "WarmupDecayLR"},
			{"WarmupCosineLR", NewWarmupCosine(c.warmup, c.total), true, "WarmupCosineLR"},
			{"LinearWarmup", NewLinearWarmup(c.warmup, c.total), false, ""},
			{"CosineWarmup", NewCosineWarmup(c.warmup, c.total), false, ""},
		} {
			if sc.dsWarmup && c.warmup < 1 {
				continue // DeepSpeed refuses a warmup of 0
			}
			want := c.total < c.warmup || sc.dsWarmup && c.total < 2
			got := notices(sc.s)
			if (len(got) == 1) != want || len(got) > 1 || want && !strings.Contains(got[0], fmt.Sprintf("TotalSteps %d is below WarmupSteps %d", c.total, c.warmup)) {
				t.Errorf("%s, warmup %d of %d steps: notices %q, want one: %v", sc.name, c.warmup, c.total, got, want)
			}
			if sc.json == "" {
				continue
			}
			ds, err := ReadDeepSpeed([]byte(fmt.Sprintf(`{"zero_optimization": {"stage": 2}, "scheduler": {"type": %q, "params": {"warmup_num_steps": %d, "total_num_steps": %d}}}`,
				sc.json, c.warmup, c.total)), DeepSpeedOptions{World: 1})
			if err != nil {
				t.Fatal(err)
			}
			if noticed := slices.ContainsFunc(ds.Notices, func(n DeepSpeedNotice) bool { return n.Path == "scheduler.params.total_num_steps" }); noticed != want {
				t.Errorf("%s from JSON, warmup %d of %d steps: noticed %v, want %v as from Go", sc.json, c.warmup, c.total, noticed, want)
			}
		}
	}
	ds, err := ReadDeepSpeed([]byte(`{"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5}}}`), DeepSpeedOptions{World: 1})
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(ds.Notices, func(n DeepSpeedNotice) bool { return n.Path == "scheduler.params.total_num_steps" }); i < 0 ||
		!strings.Contains(ds.Notices[i].Text, "DeepSpeed's default warmup_num_steps 1000 (unset)") {
		t.Errorf("warmup_num_steps unset: %v, want a notice that names DeepSpeed's default as such", ds.Notices)
	}
}
