package zero

import (
	"fmt"
	"math"
)

// The learning-rate schedules of DeepSpeed (WarmupLR, WarmupDecayLR,
// WarmupCosineLR, OneCycle) and the Hugging Face Trainer's PyTorch
// schedules (linear and cosine with warmup), as Schedule values for
// Config.Optimizer.Schedule.
//
// A schedule's only state is t, the optimizer steps taken (a skipped step
// does not count), which the engine keeps and checkpoints save. Everything
// else is in its exported fields, which are the schedule's whole
// description in the settings record: New compares them across ranks, and
// each checkpoint's manifest stores them beside t, so a resumed run with
// the same schedule continues the same curve from the same step.
//
// Timing follows the schedulers as their engines step them. DeepSpeed sets
// the rate when the scheduler is built and steps it after each applied
// optimizer step, so step t runs with the rate of its scheduler's index
// t−1 (the first step with the value at index −1: the minimum, or 0 for
// WarmupCosineLR). PyTorch's LambdaLR steps once when it is built, so step
// t runs with the factor at t.
//
// Each is made by its constructor, which sets DeepSpeed's (or PyTorch's)
// defaults; change the fields you need after. A literal is refused at New,
// because its unset fields cannot be told from zeros. The constructors
// take their arguments in one order: the rates, then the warmup steps,
// then the total steps.

// WarmupType is how a DeepSpeed warmup rises from its minimum to its
// maximum: WarmupLog (DeepSpeed's default) or WarmupLinear.
type WarmupType int

// The warmup curves.
const (
	// WarmupLog rises as log(i+1)/log(N) over the N warmup steps.
	WarmupLog WarmupType = iota
	// WarmupLinear rises as i/N.
	WarmupLinear
)

// String names the curve as DeepSpeed's warmup_type does: "log" or
// "linear".
func (w WarmupType) String() string {
	switch w {
	case WarmupLog:
		return "log"
	case WarmupLinear:
		return "linear"
	}
	return fmt.Sprintf("WarmupType(%d)", int(w))
}

// warmupGamma is DeepSpeed's warmup fraction at index i < n, n ≥ 2.
func warmupGamma(w WarmupType, i, n int) float64 {
	if w == WarmupLinear {
		return float64(i) / float64(n)
	}
	return 1 / math.Log(float64(n)) * math.Log(float64(i+1)) // DeepSpeed's order of operations
}

// WarmupLR is DeepSpeed's WarmupLR: the rate rises from MinLR to MaxLR
// over WarmupSteps steps, then stays at MaxLR.
type WarmupLR struct {
	MinLR       float64    `zero:"match"` // warmup_min_lr (default 0)
	MaxLR       float64    `zero:"match"` // warmup_max_lr; unused with GroupMaxLR
	WarmupSteps int        `zero:"match"` // warmup_num_steps, ≥ 1 (default 1000; counted as at least 2, as DeepSpeed does)
	Warmup      WarmupType `zero:"match"` // warmup_type (default log)
	// GroupMaxLR takes each group's own rate as the maximum: DeepSpeed's
	// WarmupLR without warmup_max_lr.
	GroupMaxLR bool `zero:"match"`
	set        bool
}

// NewWarmupLR is DeepSpeed's WarmupLR from minLR to maxLR over steps
// steps, with its default log warmup.
func NewWarmupLR(minLR, maxLR float64, steps int) WarmupLR {
	return WarmupLR{MinLR: minLR, MaxLR: maxLR, WarmupSteps: steps, set: true}
}

// At gives the group its rate for step t (see Schedule).
func (s WarmupLR) At(t int, base Optimizer) Optimizer {
	maxLR := s.MaxLR
	if s.GroupMaxLR {
		maxLR = optLR(base)
	}
	return withLR(base, s.MinLR+(maxLR-s.MinLR)*warmupDecay(t-1, s.Warmup, s.WarmupSteps, -1))
}

// warmupDecay is the fraction of (max − min) that DeepSpeed's WarmupLR
// (total < 0) or WarmupDecayLR gives at scheduler index i.
func warmupDecay(i int, w WarmupType, steps, total int) float64 {
	n := max(2, steps)
	switch {
	case i < 0:
		return 0
	case i < n:
		return warmupGamma(w, i, n)
	case total < 0:
		return 1
	}
	return max(0, float64(total-i)/float64(max(1, total-n)))
}

func (s WarmupLR) checkSchedule(at string) error {
	if !s.set {
		return errorf(ErrConfig, "%s is a WarmupLR literal, whose unset fields cannot be told from zeros; build it with zero.NewWarmupLR and change the fields you need", at)
	}
	if s.GroupMaxLR && s.MaxLR != 0 {
		return errorf(ErrConfig, "%s: MaxLR %v with GroupMaxLR; give one (GroupMaxLR takes each group's rate as the maximum)", at, s.MaxLR)
	}
	return checkWarmup(at, s.MinLR, s.MaxLR, s.WarmupSteps, s.Warmup)
}

func checkWarmup(at string, minLR, maxLR float64, steps int, w WarmupType) error {
	switch {
	case !settled(minLR, 0) || !settled(maxLR, 0):
		return errorf(ErrConfig, "%s rates %v to %v; use finite rates ≥ 0", at, minLR, maxLR)
	case steps < 1:
		return errorf(ErrConfig, "%s.WarmupSteps %d; use 1 or more (DeepSpeed refuses a count ≤ 0)", at, steps)
	case w != WarmupLog && w != WarmupLinear:
		return errorf(ErrConfig, "%s.Warmup %v; use WarmupLog or WarmupLinear", at, w)
	}
	return nil
}

// WarmupDecayLR is DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then a
// linear decay to 0 at TotalSteps.
type WarmupDecayLR struct {
	TotalSteps  int        `zero:"match"` // total_num_steps
	MinLR       float64    `zero:"match"` // warmup_min_lr (default 0)
	MaxLR       float64    `zero:"match"` // warmup_max_lr (default 0.001)
	WarmupSteps int        `zero:"match"` // warmup_num_steps, ≥ 1 (default 1000; at least 2)
	Warmup      WarmupType `zero:"match"` // warmup_type (default log)
	set         bool
}

// NewWarmupDecay is DeepSpeed's WarmupDecayLR, warming up from minLR to
// maxLR over warmup steps (log warmup), then decaying to 0 at total.
func NewWarmupDecay(minLR, maxLR float64, warmup, total int) WarmupDecayLR {
	return WarmupDecayLR{TotalSteps: total, MinLR: minLR, MaxLR: maxLR, WarmupSteps: warmup, set: true}
}

// NewWarmupDecayLR is NewWarmupDecay with the total first.
//
// Deprecated: use NewWarmupDecay(minLR, maxLR, warmup, total), whose
// arguments are in the order of the other schedules' constructors.
func NewWarmupDecayLR(total int, minLR, maxLR float64, warmup int) WarmupDecayLR {
	return NewWarmupDecay(minLR, maxLR, warmup, total)
}

// At gives the group its rate for step t (see Schedule).
func (s WarmupDecayLR) At(t int, base Optimizer) Optimizer {
	return withLR(base, s.MinLR+(s.MaxLR-s.MinLR)*warmupDecay(t-1, s.Warmup, s.WarmupSteps, s.TotalSteps))
}

func (s WarmupDecayLR) checkSchedule(at string) error {
	if !s.set {
		return errorf(ErrConfig, "%s is a WarmupDecayLR literal, whose unset fields cannot be told from zeros; build it with zero.NewWarmupDecayLR and change the fields you need", at)
	}
	if s.TotalSteps < 0 {
		return errorf(ErrConfig, "%s.TotalSteps %d; use the run's optimizer steps, ≥ 0", at, s.TotalSteps)
	}
	return checkWarmup(at, s.MinLR, s.MaxLR, s.WarmupSteps, s.Warmup)
}

// WarmupCosineLR is DeepSpeed's WarmupCosineLR: a multiple of each
// group's rate that warms up from WarmupMinRatio to 1, then follows a
// half cosine down to CosMinRatio at TotalSteps and stays there. The
// first step runs at rate 0, as in DeepSpeed.
type WarmupCosineLR struct {
	TotalSteps     int        `zero:"match"` // total_num_steps
	WarmupMinRatio float64    `zero:"match"` // warmup_min_ratio (default 0)
	WarmupSteps    int        `zero:"match"` // warmup_num_steps, ≥ 1 (default 1000; at least 2)
	CosMinRatio    float64    `zero:"match"` // cos_min_ratio (default 0.0001)
	Warmup         WarmupType `zero:"match"` // warmup_type (default log)
	set            bool
}

// NewWarmupCosine is DeepSpeed's WarmupCosineLR with warmup steps of
// warmup over total steps, and its defaults: ratios from 0 to 1, down to
// 0.0001, log warmup.
func NewWarmupCosine(warmup, total int) WarmupCosineLR {
	return WarmupCosineLR{TotalSteps: total, WarmupSteps: warmup, CosMinRatio: 0.0001, set: true}
}

// NewWarmupCosineLR is NewWarmupCosine with the total first.
//
// Deprecated: use NewWarmupCosine(warmup, total), whose arguments are in
// the order of the other schedules' constructors.
func NewWarmupCosineLR(total, warmup int) WarmupCosineLR {
	return NewWarmupCosine(warmup, total)
}

// At gives the group its rate for step t (see Schedule).
func (s WarmupCosineLR) At(t int, base Optimizer) Optimizer {
	i, n := t-1, max(2, s.WarmupSteps)
	var ratio float64
	switch {
	case i < 0:
		ratio = 0
	case i < n:
		ratio = s.WarmupMinRatio + warmupGamma(s.Warmup, i, n)*(1-s.WarmupMinRatio)
	default:
		progress := min(1, float64(i-n+1)/float64(max(1, s.TotalSteps-n)))
		half := (1 + math.Cos(math.Pi*progress)) / 2
		ratio = max(0, s.CosMinRatio+(1-s.CosMinRatio)*half)
	}
	return withLR(base, optLR(base)*ratio)
}

func (s WarmupCosineLR) checkSchedule(at string) error {
	switch {
	case !s.set:
		return errorf(ErrConfig, "%s is a WarmupCosineLR literal, whose unset fields cannot be told from zeros; build it with zero.NewWarmupCosineLR and change the fields you need", at)
	case s.TotalSteps < 0:
		return errorf(ErrConfig, "%s.TotalSteps %d; use the run's optimizer steps, ≥ 0", at, s.TotalSteps)
	case !settled(s.WarmupMinRatio, 0) || !settled(s.CosMinRatio, 0):
		return errorf(ErrConfig, "%s ratios %v and %v; use finite ratios ≥ 0", at, s.WarmupMinRatio, s.CosMinRatio)
	}
	return checkWarmup(at, 0, 0, s.WarmupSteps, s.Warmup)
}

// OneCycle is DeepSpeed's OneCycle: the rate climbs from MinLR to MaxLR
// over FirstStepSize steps and falls back over SecondStepSize, optionally
// in stairs; after the cycle it decays from MinLR. With CycleMomentum the
// momentum moves the other way, from MaxMom down to MinMom and back, and
// decays from MaxMom after the cycle: it is AdamW's Beta1, or SGD's
// Momentum. (DeepSpeed's OneCycle also sets Adam's second beta to 0.99,
// and leaves SGD's momentum alone; ReadDeepSpeed reproduces both.) A decay
// that takes the momentum to 1 or above fails the group's check at Step.
type OneCycle struct {
	MinLR            float64 `zero:"match"` // cycle_min_lr
	MaxLR            float64 `zero:"match"` // cycle_max_lr
	DecayLRRate      float64 `zero:"match"` // decay_lr_rate (default 0: no decay)
	FirstStepSize    int     `zero:"match"` // cycle_first_step_size, ≥ 1 (default 2000)
	SecondStepSize   int     `zero:"match"` // cycle_second_step_size, ≥ 0 (DeepSpeed's default: the first's)
	FirstStairCount  int     `zero:"match"` // cycle_first_stair_count (default 0: no stairs)
	SecondStairCount int     `zero:"match"` // cycle_second_stair_count (DeepSpeed's default: the first's)
	DecayStepSize    int     `zero:"match"` // decay_step_size (default 0: no decay)
	CycleMomentum    bool    `zero:"match"` // cycle_momentum (default true)
	MinMom           float64 `zero:"match"` // cycle_min_mom (default 0.8)
	MaxMom           float64 `zero:"match"` // cycle_max_mom (default 0.9)
	DecayMomRate     float64 `zero:"match"` // decay_mom_rate (default 0: no decay)
	set              bool
}

// NewOneCycle is DeepSpeed's OneCycle between minLR and maxLR with its
// defaults: 2000 steps up and 2000 down, no stairs, no decay, the momentum
// cycled between 0.8 and 0.9.
func NewOneCycle(minLR, maxLR float64) OneCycle {
	return OneCycle{MinLR: minLR, MaxLR: maxLR, FirstStepSize: 2000, SecondStepSize: 2000,
		CycleMomentum: true, MinMom: 0.8, MaxMom: 0.9, set: true}
}

// At gives the group its rate (and momentum) for step t (see Schedule).
func (s OneCycle) At(t int, base Optimizer) Optimizer {
	i := t - 1
	total := float64(s.FirstStepSize + s.SecondStepSize)
	var lr, mom float64
	switch {
	case i < 0: // as the scheduler is built: the cycle's minimum of both
		lr, mom = s.MinLR, s.MinMom
	case float64(i) < total:
		f := s.scale(i + 1)
		lr, mom = s.MinLR+(s.MaxLR-s.MinLR)*f, s.MaxMom-(s.MaxMom-s.MinMom)*f
	default:
		interval := 0.0
		if s.DecayStepSize != 0 {
			interval = (float64(i) - total + 1) / float64(s.DecayStepSize)
		}
		lr, mom = s.MinLR, s.MaxMom
		if s.DecayStepSize != 0 && s.DecayLRRate != 0 {
			lr = s.MinLR / (1 + s.DecayLRRate*interval)
		}
		if s.DecayStepSize != 0 && s.DecayMomRate != 0 {
			mom = s.MaxMom * (1 + s.DecayMomRate*interval)
		}
	}
	out := withLR(base, lr)
	if !s.CycleMomentum {
		return out
	}
	switch o := out.(type) {
	case AdamW:
		o.Beta1 = mom
		return o
	case SGD:
		o.Momentum = mom
		return o
	}
	return out
}

// scale is the cycle's height at batch b: 0 at its ends, 1 at its peak.
func (s OneCycle) scale(b int) float64 {
	first, second := float64(s.FirstStepSize), float64(s.SecondStepSize)
	total := first + second
	ratio := first / total
	x := 1 + float64(b)/total - math.Floor(1+float64(b)/total)
	f, stairs := x/ratio, s.FirstStairCount
	if x > ratio {
		f, stairs = (x-1)/(ratio-1), s.SecondStairCount
	}
	if stairs > 0 { // from the integer position in the cycle, so a peak is reached exactly
		pos := math.Mod(float64(b), total)
		if pos <= first {
			f = math.Floor(pos*float64(stairs)/first) / float64(stairs)
		} else {
			f = math.Floor((total-pos)*float64(stairs)/second) / float64(stairs)
		}
	}
	return f
}

func (s OneCycle) checkSchedule(at string) error {
	switch {
	case !s.set:
		return errorf(ErrConfig, "%s is a OneCycle literal, whose unset fields cannot be told from zeros; build it with zero.NewOneCycle and change the fields you need", at)
	case !settled(s.MinLR, 0) || !settled(s.MaxLR, 0) || !settled(s.DecayLRRate, 0):
		return errorf(ErrConfig, "%s rates %v to %v, decay %v; use finite values ≥ 0", at, s.MinLR, s.MaxLR, s.DecayLRRate)
	case s.FirstStepSize < 1 || s.SecondStepSize < 0:
		return errorf(ErrConfig, "%s step sizes %d and %d; use a first half ≥ 1 step and a second ≥ 0 (DeepSpeed refuses the same)", at, s.FirstStepSize, s.SecondStepSize)
	case s.FirstStairCount < 0 || s.SecondStairCount < 0 || s.DecayStepSize < 0:
		return errorf(ErrConfig, "%s stair counts %d and %d, decay step size %d; use counts ≥ 0", at, s.FirstStairCount, s.SecondStairCount, s.DecayStepSize)
	case s.CycleMomentum && (!settled(s.MinMom, 0) || !settled(s.MaxMom, 0) || !settled(s.DecayMomRate, 0)):
		return errorf(ErrConfig, "%s momenta %v to %v, decay %v; use finite values ≥ 0", at, s.MinMom, s.MaxMom, s.DecayMomRate)
	}
	return nil
}

// LinearWarmup is PyTorch's linear schedule with warmup, as the Hugging
// Face Trainer makes it (get_linear_schedule_with_warmup): a multiple of
// each group's rate that rises as t/WarmupSteps, then falls linearly to 0
// at TotalSteps.
type LinearWarmup struct {
	WarmupSteps int `zero:"match"` // num_warmup_steps, ≥ 0
	TotalSteps  int `zero:"match"` // num_training_steps, ≥ 0
	set         bool
}

// NewLinearWarmup is the linear schedule with warmup steps of warmup over
// total steps.
func NewLinearWarmup(warmup, total int) LinearWarmup {
	return LinearWarmup{WarmupSteps: warmup, TotalSteps: total, set: true}
}

// At gives the group its rate for step t (see Schedule).
func (s LinearWarmup) At(t int, base Optimizer) Optimizer {
	f := 0.0
	if t < s.WarmupSteps {
		f = float64(t) / float64(max(1, s.WarmupSteps))
	} else {
		f = max(0, float64(s.TotalSteps-t)/float64(max(1, s.TotalSteps-s.WarmupSteps)))
	}
	return withLR(base, optLR(base)*f)
}

func (s LinearWarmup) checkSchedule(at string) error {
	return checkLambda(at, "LinearWarmup", "NewLinearWarmup", s.set, s.WarmupSteps, s.TotalSteps)
}

func checkLambda(at, name, ctor string, set bool, warmup, total int) error {
	switch {
	case !set:
		return errorf(ErrConfig, "%s is a %s literal, whose unset fields cannot be told from zeros; build it with zero.%s", at, name, ctor)
	case warmup < 0 || total < 0:
		return errorf(ErrConfig, "%s warmup %d of %d steps; use counts ≥ 0", at, warmup, total)
	}
	return nil
}

// CosineWarmup is PyTorch's cosine schedule with warmup, as the Hugging
// Face Trainer makes it (get_cosine_schedule_with_warmup): a multiple of
// each group's rate that rises as t/WarmupSteps, then follows Cycles
// cosine periods (default a half: down to 0 at TotalSteps).
type CosineWarmup struct {
	WarmupSteps int     `zero:"match"` // num_warmup_steps, ≥ 0
	TotalSteps  int     `zero:"match"` // num_training_steps, ≥ 0
	Cycles      float64 `zero:"match"` // num_cycles (default 0.5)
	set         bool
}

// NewCosineWarmup is the cosine schedule with warmup steps of warmup over
// total steps, half a period.
func NewCosineWarmup(warmup, total int) CosineWarmup {
	return CosineWarmup{WarmupSteps: warmup, TotalSteps: total, Cycles: 0.5, set: true}
}

// At gives the group its rate for step t (see Schedule).
func (s CosineWarmup) At(t int, base Optimizer) Optimizer {
	f := 0.0
	if t < s.WarmupSteps {
		f = float64(t) / float64(max(1, s.WarmupSteps))
	} else {
		progress := float64(t-s.WarmupSteps) / float64(max(1, s.TotalSteps-s.WarmupSteps))
		f = max(0, 0.5*(1+math.Cos(math.Pi*s.Cycles*2*progress)))
	}
	return withLR(base, optLR(base)*f)
}

func (s CosineWarmup) checkSchedule(at string) error {
	if err := checkLambda(at, "CosineWarmup", "NewCosineWarmup", s.set, s.WarmupSteps, s.TotalSteps); err != nil {
		return err
	}
	if math.IsNaN(s.Cycles) || math.IsInf(s.Cycles, 0) {
		return errorf(ErrConfig, "%s.Cycles %v; use a finite number of periods (0.5: down to 0 once)", at, s.Cycles)
	}
	return nil
}

// warmupOutlasts reports whether a run of total steps ends before a
// warmup of warmup steps does, counted as DeepSpeed counts it (at least 2
// for its schedules, dsWarmup): DeepSpeed warns of it, and so does zero.
func warmupOutlasts(total, warmup int, dsWarmup bool) bool {
	if dsWarmup {
		warmup = max(2, warmup)
	}
	return total < warmup
}

// scheduleNotices are what zero says of a schedule's settings without
// refusing them (Engine.Notices): a warmup longer than the run.
func scheduleNotices(s Schedule) []string {
	var total, warmup int
	ds := true
	switch s := s.(type) {
	case WarmupDecayLR:
		total, warmup = s.TotalSteps, s.WarmupSteps
	case WarmupCosineLR:
		total, warmup = s.TotalSteps, s.WarmupSteps
	case LinearWarmup:
		total, warmup, ds = s.TotalSteps, s.WarmupSteps, false
	case CosineWarmup:
		total, warmup, ds = s.TotalSteps, s.WarmupSteps, false
	default:
		return nil
	}
	if !warmupOutlasts(total, warmup, ds) {
		return nil
	}
	counted := ""
	if ds && warmup < 2 {
		counted = ", counted as 2 as DeepSpeed counts it"
	}
	return []string{fmt.Sprintf("Optimizer.Schedule (%T): TotalSteps %d is below WarmupSteps %d%s: the run ends before the warmup does (DeepSpeed warns of it too); check the constructor's arguments: the warmup comes before the total",
		s, total, warmup, counted)}
}

// optLR is a group's rate.
func optLR(o Optimizer) float64 {
	switch o := o.(type) {
	case AdamW:
		return o.LR
	case SGD:
		return o.LR
	}
	return 0
}

// withLR is o with rate lr.
func withLR(o Optimizer, lr float64) Optimizer {
	switch o := o.(type) {
	case AdamW:
		o.LR = lr
		return o
	case SGD:
		o.LR = lr
		return o
	}
	return o
}

// settled reports whether a schedule's rate or ratio is at least lo and
// finite (NaN is neither). The schedules use only the exported API and the
// schedule-check hook, so they keep their own copy of config.go's finite.
func settled(x, lo float64) bool { return x >= lo && !math.IsInf(x, 0) }
