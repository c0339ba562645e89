package zero

import (
	"fmt"
	"math"
)

// Config sets up an Engine. DefaultConfig gives working values. A setting
// left at its zero value takes the default named beside it where zero is
// not a legal value; Stage and BucketBytes must be set. The settings are
// grouped by policy, as PyTorch FSDP2 groups its own.
//
// Each leaf field carries its class (the zero tag): "match" must be the
// same on every rank and when a checkpoint is reloaded; "reshard" must be
// the same on every rank but may change on reload (world size, stage,
// layout, budgets, the batch split); "local" may differ between ranks, because it changes
// neither the collectives nor the bits (the reason is in the tag). New
// compares every non-local setting across ranks by name.
type Config struct {
	Stage       int `zero:"reshard"` // 1, 2 or 3
	BucketBytes int `zero:"reshard"` // bytes of model-dtype gradient per bucket
	// Overlap reduces on the engine's own stream with double-buffered
	// buckets, so the next bucket fills while the last one is reduced.
	// Without it, reductions run in order on the caller's stream.
	Overlap bool `zero:"local:reductions run on another stream, in the same order, with the same bits"`
	// StagingBuffers is the initial size of the bucket buffer pool
	// (default 2, at most 64).
	StagingBuffers int `zero:"local:the pool's size changes no collective and no bit"`
	// Align is the shard granularity in elements (default 64, at most 65536).
	Align int `zero:"reshard"`

	Precision PrecisionPolicy // dtypes on the wire, loss scaling
	Grads     GradPolicy      // mean or sum, pre-division, backwards per step
	Optimizer OptimizerPolicy // the optimizer groups, clipping
	Window    WindowPolicy    // coalesced windows and NoSync
	Params    ParamPolicy     // loading, stage-3 prefetch
	Offload   OffloadPolicy   // CPU offload
}

// PrecisionPolicy is the dtypes on the wire and the loss scaling.
type PrecisionPolicy struct {
	// CommDType is the dtype on the wire: the model dtype (default) or FP32.
	CommDType DType `zero:"match"`
	// ShardDType is the dtype the reduced gradient shard is summed in: FP32
	// (default) or the model dtype, half the shard's memory, each reduction
	// summed in fp32 and rounded once to it as it lands (DeepSpeed's
	// grad_accum_dtype; its ZeRO-2 default for bf16). Without a window a
	// step of N backwards rounds N times: measured against float64, about
	// twice the fp32 shard's error (README, "Memory").
	ShardDType DType `zero:"reshard"`
	// LossScale is the loss scaling (dynamic for fp16 by default).
	LossScale LossScale
	// KeepNonFinite steps even when a gradient is inf or NaN with fp32 or
	// bf16 gradients (by default such a step is skipped; fp16 always skips).
	KeepNonFinite bool `zero:"match"`
}

// GradPolicy is how the gradients of a window are combined.
type GradPolicy struct {
	// Reduction is what Step leaves in the shard: the mean over ranks and
	// backwards (default) or their sum.
	Reduction Reduction `zero:"match"`
	// PredivideFactor f scales by 1/f before the sum across ranks and by
	// f/W after it (default 1): a guard against overflow on the wire.
	PredivideFactor float64 `zero:"match"`
	// AccumSteps fixes the number of backwards G between Steps; a Step
	// after any other number is an error. 0 (default) takes G from the
	// backwards actually taken. It is no state: a checkpoint of W ranks
	// and G backwards resumes at W' and G' (the same global batch, split
	// otherwise).
	AccumSteps int `zero:"reshard"`
}

// OptimizerPolicy is the partitioned optimizer.
type OptimizerPolicy struct {
	// Groups are the optimizer of each parameter group (Param.Group indexes
	// them), all AdamW or all SGD, each made by NewAdamW or NewSGD. With
	// Groups, Step runs the optimizer on the fp32 master shard and writes
	// the new parameters; without, Step only reduces, for callers with
	// their own optimizer. SetGroup changes a group between steps.
	Groups []Optimizer `zero:"match"`
	// Clip is the largest global gradient norm (0: no clipping): the
	// gradient is scaled by 1/max(1, norm/Clip).
	Clip float64 `zero:"match"`
	// Schedule, if set, gives every group's settings step by step (a
	// learning-rate schedule; OneCycle's momentum): see Schedule.
	Schedule Schedule `zero:"match"`
}

// Schedule gives the optimizer groups' settings step by step. Before each
// step's optimizer pass, group g runs with At(t, base), where t counts the
// optimizer steps taken so far (a skipped step does not advance it, as in
// DeepSpeed) and base is the group's settings from Config or the last
// SetGroup. At must depend on its arguments alone, so every rank gets the
// same settings; its result must be of base's kind and pass its checks.
// The schedule's own settings are part of the settings record (its
// exported fields, compared across ranks), and t is saved in checkpoints;
// a schedule keeps no other state, so the record describes it whole.
// schedule.go has DeepSpeed's schedules (WarmupLR, WarmupDecayLR,
// WarmupCosineLR, OneCycle) and PyTorch's linear and cosine with warmup.
type Schedule interface {
	// At is a group's settings for step t, from its base settings.
	At(t int, base Optimizer) Optimizer
}

// scheduleChecker is a schedule that checks its own settings at New, as
// the package's schedules (schedule.go) do.
type scheduleChecker interface {
	checkSchedule(at string) error
}

// WindowPolicy is the coalesced window and NoSync.
type WindowPolicy struct {
	// BudgetBytes caps the local sums of a coalesced window or NoSync (0:
	// every bucket is deferred): only the buckets that backward produces
	// last are deferred (summed locally, reduced once), as many as fit; the
	// others are reduced every backward.
	BudgetBytes int `zero:"reshard"`
	// DType is the dtype of the local sums, a window's and ZeRO-1's own:
	// FP32 (default) or the model dtype, half the memory for bf16 and fp16,
	// each backward's sum rounded to it as a framework's .grad is
	// (DeepSpeed's choice). Where it is also the comm dtype and the
	// ShardDType, the shard's own memory hosts some of them until their
	// flush (README, "Memory"). The sums live within a step, so a
	// checkpoint resumes under another DType.
	DType DType `zero:"reshard"`
}

// ParamPolicy is how the parameters are loaded and, at stage 3, gathered.
type ParamPolicy struct {
	// NoBroadcast keeps each rank's own parameters at New instead of
	// copying rank 0's to every rank first.
	NoBroadcast bool `zero:"reshard"`
	// PrefetchBytes is how far ahead of the framework's gathers a stage-3
	// engine gathers, in the order of the last window (default BucketBytes;
	// negative: no prefetch).
	PrefetchBytes int `zero:"reshard"`
	// LiveParamBytes caps the gathered bytes that prefetching may reach (0:
	// no cap); gathers the framework asks for always run.
	LiveParamBytes int `zero:"reshard"`
}

// OffloadPolicy is CPU offload.
type OffloadPolicy struct {
	// Optimizer keeps the fp32 gradient shard, the fp32 master weights and
	// the optimizer state in page-locked host memory (DeepSpeed's
	// offload_optimizer): each reduced shard is copied to the host as its
	// reduction finishes and summed there, the optimizer runs on the host,
	// and the new parameters are copied back. On the CPU device the same
	// buffers and copies run in RAM.
	Optimizer bool `zero:"local:the same collectives and bits; the sums and the optimizer run on the host"`
	// Params keeps stage 3's parameter shard, in the model dtype, in
	// page-locked host memory (DeepSpeed's offload_param): each gather
	// copies this rank's part of the bucket from the host into the
	// bucket's gather buffer on the gather stream and all-gathers it in
	// place, so the device holds only gathered buckets; the step writes the
	// new parameters into the host shard. Stage 3 only.
	Params bool `zero:"local:the same collectives and bits; the shard is copied from the host before each gather"`
}

// Reduction says how Step combines the gradients of a window.
type Reduction int

// The reductions Step can leave in the shard.
const (
	// Mean leaves (1/(W·G)) Σ_ranks Σ_backwards grad: the mean over the W
	// ranks and the G backwards of the window.
	Mean Reduction = iota
	// Sum leaves Σ_ranks Σ_backwards grad, for callers that scale the loss
	// themselves.
	Sum
)

// String names the reduction as "mean" or "sum".
func (r Reduction) String() string {
	switch r {
	case Mean:
		return "mean"
	case Sum:
		return "sum"
	}
	return fmt.Sprintf("Reduction(%d)", int(r))
}

// DefaultConfig is ZeRO-2 with overlap and 32 MiB buckets.
func DefaultConfig() Config {
	return Config{Stage: 2, BucketBytes: 32 << 20, Overlap: true}
}

// Param describes a parameter at registration.
type Param struct {
	// Name identifies the parameter in errors, checkpoints and exports:
	// names that are given must be unique, and checkpoints and exports need
	// every parameter named.
	Name  string
	Count int   // elements; 0 is allowed (the parameter gets no bucket)
	Shape []int // optional: its product must be Count
	DType DType // the gradient's dtype: one for all parameters of an engine
	// Data is the parameter's memory (the framework's tensor, on the
	// engine's device), read at New. At stages 1 and 2 each Step that runs
	// an optimizer writes the new values into it. At stage 3 the engine
	// keeps the parameters sharded and Data is read at New only (it may be
	// freed after); Gather gives views of the current values.
	Data Tensor
	// Group is the parameter's optimizer group, an index into
	// Config.Optimizer.Groups.
	Group int
	// Frozen parameters get no gradient, no bucket and no update.
	Frozen bool
	// Init builds a stage-3 model sharded (instead of Data): New calls it
	// for this rank's part of the parameter only, to fill dst with elements
	// [offset, offset+len(dst)), so the full parameter never exists on any
	// rank. It must give every rank the same values for an element (seed by
	// position, not by rank).
	Init func(dst []float32, offset int) error
}

// ---- optimizers -----------------------------------------------------------------

// Optimizer is the optimizer of a parameter group: AdamW or SGD, with
// PyTorch's formulas, made by NewAdamW or NewSGD. Every group of an engine
// uses the same kind.
type Optimizer interface {
	kind() optKind
	made() bool
	check(path string) error
	// rangeFor fills the settings of one parameter's range for its t-th step.
	rangeFor(r *optRange, t int)
	// rate is the learning rate, as Stats.LR reports it.
	rate() float64
}

// AdamW is torch.optim.AdamW: decoupled weight decay, bias correction, eps
// outside the square root, optionally amsgrad. Make it with NewAdamW, which
// sets PyTorch's defaults, then change the fields you need: a value set to
// 0 stays 0 (betas of 0 are legal), and a literal AdamW{} is refused,
// because its unset fields cannot be told from zeros.
type AdamW struct {
	LR          float64 `zero:"match"` // learning rate (0 is legal: a warmup starts there)
	Beta1       float64 `zero:"match"` // decay of the first moment, in [0, 1) (default 0.9)
	Beta2       float64 `zero:"match"` // decay of the second moment, in [0, 1) (default 0.999)
	Eps         float64 `zero:"match"` // added to the root of the second moment, > 0 (default 1e-8)
	WeightDecay float64 `zero:"match"` // decoupled: p *= 1 - LR·WeightDecay (default 0)
	AMSGrad     bool    `zero:"match"` // use the running maximum of the second moment
	set         bool    // made by NewAdamW
}

// NewAdamW is AdamW with learning rate lr and PyTorch's defaults: betas
// (0.9, 0.999), eps 1e-8, no weight decay, no amsgrad.
func NewAdamW(lr float64) AdamW {
	return AdamW{LR: lr, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, set: true}
}

// made marks a group read back from a checkpoint as made by its
// constructor.
func made(g Optimizer) Optimizer {
	switch g := g.(type) {
	case AdamW:
		g.set = true
		return g
	case SGD:
		g.set = true
		return g
	}
	return g
}

// SGD is torch.optim.SGD: weight decay added to the gradient, momentum
// with dampening, optionally Nesterov. Make it with NewSGD (a literal SGD{}
// is refused, as AdamW{} is).
type SGD struct {
	LR          float64 `zero:"match"` // learning rate (0 is legal)
	Momentum    float64 `zero:"match"` // ≥ 0 (default 0: none)
	Dampening   float64 `zero:"match"` // of the momentum, in [0, 1] (default 0)
	WeightDecay float64 `zero:"match"` // added to the gradient: g += WeightDecay·p (default 0)
	Nesterov    bool    `zero:"match"` // Nesterov momentum (needs Momentum, no Dampening)
	set         bool    // made by NewSGD
}

// NewSGD is SGD with learning rate lr and PyTorch's defaults: no momentum,
// no dampening, no weight decay.
func NewSGD(lr float64) SGD { return SGD{LR: lr, set: true} }

func (o AdamW) rate() float64 { return o.LR }
func (o SGD) rate() float64   { return o.LR }

func (o AdamW) kind() optKind { return optAdamW }
func (o SGD) kind() optKind   { return optSGD }
func (o AdamW) made() bool    { return o.set }
func (o SGD) made() bool      { return o.set }

// finite reports whether x is a finite number ≥ lo.
func finite(x, lo float64) bool { return x >= lo && !math.IsInf(x, 0) }

func (o AdamW) check(at string) error {
	switch {
	case !o.set:
		return errorf(ErrConfig, "%s is an AdamW literal, whose unset fields cannot be told from zeros; build it with zero.NewAdamW(lr) and change the fields you need", at)
	case !finite(o.LR, 0):
		return errorf(ErrConfig, "%s.LR %v; use a finite rate ≥ 0", at, o.LR)
	case !(o.Beta1 >= 0 && o.Beta1 < 1) || !(o.Beta2 >= 0 && o.Beta2 < 1):
		return errorf(ErrConfig, "%s betas (%v, %v); use values in [0, 1)", at, o.Beta1, o.Beta2)
	case !(o.Eps > 0) || math.IsInf(o.Eps, 0):
		return errorf(ErrConfig, "%s.Eps %v; use a finite value > 0 (PyTorch's default is 1e-8)", at, o.Eps)
	case !finite(o.WeightDecay, 0):
		return errorf(ErrConfig, "%s.WeightDecay %v; use a finite value ≥ 0", at, o.WeightDecay)
	}
	return nil
}

func (o SGD) check(at string) error {
	switch {
	case !o.set:
		return errorf(ErrConfig, "%s is an SGD literal, whose unset rate cannot be told from 0; build it with zero.NewSGD(lr) and change the fields you need", at)
	case !finite(o.LR, 0):
		return errorf(ErrConfig, "%s.LR %v; use a finite rate ≥ 0", at, o.LR)
	case !finite(o.Momentum, 0) || !(o.Dampening >= 0 && o.Dampening <= 1):
		return errorf(ErrConfig, "%s momentum %v, dampening %v; use momentum ≥ 0 and dampening in [0, 1]", at, o.Momentum, o.Dampening)
	case !finite(o.WeightDecay, 0):
		return errorf(ErrConfig, "%s.WeightDecay %v; use a finite value ≥ 0", at, o.WeightDecay)
	case o.Nesterov && (o.Momentum == 0 || o.Dampening != 0):
		return errorf(ErrConfig, "%s: Nesterov needs a momentum and zero dampening", at)
	}
	return nil
}

// LossScale configures loss scaling. With fp16 gradients the scale is
// dynamic by default, DeepSpeed's DynamicLossScaler: it starts at Initial
// (2^16), halves on an overflow once Hysteresis (2) overflows have been
// absorbed, never goes below Min (1), and doubles (giving the hysteresis
// back) once a multiple of Window (1000) clean steps has followed the
// last overflow, the step after it not counted. It is the scale of the
// step's mean loss, as DeepSpeed's: with Grads.AccumSteps G each backward
// carries it divided by G (Engine.LossScale).
// Static fixes it (any dtype); with fp32 and bf16 it is 1 by default and
// the dynamic fields are ignored. Zero is not a legal value of any field,
// so 0 means the default.
type LossScale struct {
	Static     float64 `zero:"match"` // a fixed scale (0: dynamic for fp16, 1 otherwise)
	Initial    float64 `zero:"match"` // dynamic: the first scale (default 2^16)
	Window     int     `zero:"match"` // dynamic: steps without overflow before doubling (default 1000)
	Hysteresis int     `zero:"match"` // dynamic: overflows absorbed before halving (default 2)
	Min        float64 `zero:"match"` // dynamic: the smallest scale (default 1)
}

// resolve fills in the defaults and checks the scaling for gradients of
// dtype model. The resolved form is what every rank compares: Static is 0
// exactly when the scale is dynamic.
func (c *LossScale) resolve(model DType) error {
	dynamic := c.Initial != 0 || c.Window != 0 || c.Hysteresis != 0 || c.Min != 0
	switch {
	case !finite(c.Static, 0):
		return errorf(ErrConfig, "Precision.LossScale.Static %v; use a finite scale > 0, or 0 for the default", c.Static)
	case c.Static > 0 && dynamic:
		return errorf(ErrConfig, "Precision.LossScale %+v: a static scale with dynamic settings; give Static or the dynamic fields, not both", *c)
	case c.Static == 0 && model != FP16: // the dynamic fields are fp16's
		*c = LossScale{Static: 1}
	}
	if c.Static > 0 {
		return nil
	}
	if c.Initial == 0 {
		c.Initial = 1 << 16
	}
	if c.Window == 0 {
		c.Window = 1000
	}
	if c.Hysteresis == 0 {
		c.Hysteresis = 2
	}
	if c.Min == 0 {
		c.Min = 1
	}
	if !finite(c.Initial, 0) || c.Initial == 0 || c.Window < 1 || c.Hysteresis < 1 || !finite(c.Min, 0) || c.Min == 0 || c.Min > c.Initial {
		return errorf(ErrConfig, "Precision.LossScale %+v; use a finite Initial > 0, Window ≥ 1, Hysteresis ≥ 1 and 0 < Min ≤ Initial", *c)
	}
	return nil
}

// ---- checks -----------------------------------------------------------------

const (
	maxStagingBuffers = 64
	maxAlign          = 1 << 16
)

// resolve checks every setting and the parameters, and fills in the
// defaults, before New runs any collective or allocates anything. It
// returns the model dtype.
func (c *Config) resolve(params []Param) (DType, error) {
	model, err := checkParams(params)
	if err != nil {
		return 0, err
	}
	switch {
	case c.Stage < 1 || c.Stage > 3:
		return 0, errorf(ErrConfig, "Stage %d; set Stage to 1, 2 or 3", c.Stage)
	case c.BucketBytes <= 0:
		return 0, errorf(ErrConfig, "BucketBytes %d; set a positive bucket size, e.g. 32<<20", c.BucketBytes)
	case c.StagingBuffers < 0 || c.StagingBuffers > maxStagingBuffers:
		return 0, errorf(ErrConfig, "StagingBuffers %d; set 1 to %d (2 double-buffer the buckets), or 0 for 2", c.StagingBuffers, maxStagingBuffers)
	case c.Align < 0 || c.Align > maxAlign:
		return 0, errorf(ErrConfig, "Align %d; set a shard granularity of 1 to %d elements, or 0 for 64", c.Align, maxAlign)
	}
	if c.StagingBuffers == 0 {
		c.StagingBuffers = 2
	}
	if c.Align == 0 {
		c.Align = 64
	}
	if err := c.Precision.resolve(model); err != nil {
		return 0, err
	}
	if err := c.Grads.resolve(); err != nil {
		return 0, err
	}
	if err := c.Window.resolve(model); err != nil {
		return 0, err
	}
	if err := c.Params.resolve(c.BucketBytes); err != nil {
		return 0, err
	}
	if c.Offload.Params && c.Stage != 3 {
		return 0, errorf(ErrConfig, "Offload.Params at stage %d: only stage 3 keeps a parameter shard to offload (below it the parameters are the framework's memory); set Stage to 3, or leave Offload.Params off", c.Stage)
	}
	if err := c.Optimizer.check(params); err != nil {
		return 0, err
	}
	return model, checkParamMemory(params, c.Stage, len(c.Optimizer.Groups) > 0)
}

func (p *PrecisionPolicy) resolve(model DType) error {
	if p.CommDType == 0 {
		p.CommDType = model
	}
	if p.CommDType != model && p.CommDType != FP32 {
		return errorf(ErrConfig, "Precision.CommDType %v with %v gradients; use the model dtype or FP32", p.CommDType, model)
	}
	if p.ShardDType == 0 {
		p.ShardDType = FP32
	}
	if p.ShardDType != model && p.ShardDType != FP32 {
		return errorf(ErrConfig, "Precision.ShardDType %v with %v gradients; use FP32 or the model dtype", p.ShardDType, model)
	}
	return p.LossScale.resolve(model)
}

func (g *GradPolicy) resolve() error {
	if g.Reduction != Mean && g.Reduction != Sum {
		return errorf(ErrConfig, "Grads.Reduction %v; use Mean or Sum", g.Reduction)
	}
	if g.PredivideFactor == 0 {
		g.PredivideFactor = 1
	}
	if !finite(g.PredivideFactor, 0) || g.PredivideFactor == 0 {
		return errorf(ErrConfig, "Grads.PredivideFactor %v; set a finite factor > 0 (1 = no pre-division)", g.PredivideFactor)
	}
	if g.AccumSteps < 0 {
		return errorf(ErrConfig, "Grads.AccumSteps %d; set it to 1 or more, or 0 to count the backwards taken", g.AccumSteps)
	}
	return nil
}

func (w *WindowPolicy) resolve(model DType) error {
	if w.DType == 0 {
		w.DType = FP32
	}
	if w.DType != FP32 && w.DType != model {
		return errorf(ErrConfig, "Window.DType %v; use FP32 or the model dtype %v", w.DType, model)
	}
	if w.BudgetBytes < 0 {
		return errorf(ErrConfig, "Window.BudgetBytes %d; set a byte budget for a window's local sums, or 0 for none", w.BudgetBytes)
	}
	return nil
}

func (p *ParamPolicy) resolve(bucketBytes int) error {
	if p.PrefetchBytes == 0 {
		p.PrefetchBytes = bucketBytes
	}
	if p.PrefetchBytes < 0 {
		p.PrefetchBytes = -1
	}
	if p.LiveParamBytes < 0 {
		return errorf(ErrConfig, "Params.LiveParamBytes %d; set a byte budget for gathered parameters, or 0 for none", p.LiveParamBytes)
	}
	return nil
}

func (o *OptimizerPolicy) check(params []Param) error {
	if !finite(o.Clip, 0) {
		return errorf(ErrConfig, "Optimizer.Clip %v; use a finite norm > 0, or 0 for no clipping", o.Clip)
	}
	if c, ok := o.Schedule.(scheduleChecker); ok {
		if err := c.checkSchedule(fmt.Sprintf("Optimizer.Schedule (%T)", o.Schedule)); err != nil {
			return err
		}
	}
	if len(o.Groups) == 0 {
		for i, p := range params {
			if p.Group != 0 {
				return errorf(ErrParam, "parameter %d (%q) is in group %d, but no Optimizer.Groups are configured", i, p.Name, p.Group)
			}
		}
		return nil
	}
	for g, opt := range o.Groups {
		at := fmt.Sprintf("Optimizer.Groups[%d]", g)
		if opt == nil {
			return errorf(ErrConfig, "%s is nil; give zero.NewAdamW(lr) or zero.NewSGD(lr)", at)
		}
		if opt.kind() != o.Groups[0].kind() {
			return errorf(ErrConfig, "%s is %T, Groups[0] %T; every group of an engine uses one optimizer kind", at, opt, o.Groups[0])
		}
		if err := opt.check(at); err != nil {
			return err
		}
	}
	if o.Schedule != nil {
		for g, opt := range o.Groups {
			if err := checkScheduled(o.Schedule, 0, g, opt); err != nil {
				return err
			}
		}
	}
	for i, p := range params {
		if p.Group < 0 || p.Group >= len(o.Groups) {
			return errorf(ErrParam, "parameter %d (%q) is in group %d; the groups are 0..%d", i, p.Name, p.Group, len(o.Groups)-1)
		}
	}
	return nil
}

// checkScheduled refuses a schedule whose settings for step t of group g
// are not of the group's kind or do not pass their checks.
func checkScheduled(sched Schedule, t, g int, base Optimizer) error {
	at := fmt.Sprintf("Optimizer.Schedule (%T) at step %d for group %d", sched, t, g)
	opt := sched.At(t, base)
	if opt == nil || opt.kind() != base.kind() {
		return errorf(ErrConfig, "%s gave %T for a group of %T; give settings of the group's kind", at, opt, base)
	}
	return opt.check(at)
}

// checkParams checks the parameter list and returns the model dtype.
func checkParams(params []Param) (DType, error) {
	if len(params) == 0 {
		return 0, errorf(ErrParam, "no parameters; register at least one")
	}
	model := params[0].DType
	names := map[string]int{}
	for i, p := range params {
		if p.Count < 0 {
			return 0, errorf(ErrParam, "parameter %d (%q) has count %d; counts must be ≥ 0", i, p.Name, p.Count)
		}
		if !p.DType.valid() {
			return 0, errorf(ErrDType, "parameter %d (%q) has dtype %v; use FP32, BF16 or FP16", i, p.Name, p.DType)
		}
		if p.DType != model {
			return 0, errorf(ErrDType, "parameter %d (%q) is %v but parameter 0 is %v; register one dtype per engine", i, p.Name, p.DType, model)
		}
		if p.Shape != nil {
			n := 1
			for _, d := range p.Shape {
				if d < 0 || d > 0 && n > math.MaxInt/d {
					return 0, errorf(ErrParam, "parameter %d (%q) has shape %v; give dimensions ≥ 0 whose product is Count", i, p.Name, p.Shape)
				}
				n *= d
			}
			if n != p.Count {
				return 0, errorf(ErrParam, "parameter %d (%q) has shape %v (%d elements) and count %d; make them agree", i, p.Name, p.Shape, n, p.Count)
			}
		}
		if p.Name != "" {
			if j, dup := names[p.Name]; dup {
				return 0, errorf(ErrParam, "parameters %d and %d are both named %q; names identify parameters and must be unique", j, i, p.Name)
			}
			names[p.Name] = i
		}
	}
	return model, nil
}

// checkParamMemory validates Data and Init: both at once, Init below stage
// 3, or memory for some trained parameters and not for others, are errors.
func checkParamMemory(params []Param, stage int, optimizer bool) error {
	with, without := -1, -1
	for i, p := range params {
		if err := p.Data.check(fmt.Sprintf("parameter %d (%q): Data", i, p.Name)); err != nil {
			return err
		}
		if p.Init != nil && p.Data.count > 0 {
			return errorf(ErrParam, "parameter %d (%q) has both Data and Init; give one", i, p.Name)
		}
		if p.Init != nil && stage != 3 {
			return errorf(ErrParam, "parameter %d (%q) has Init at stage %d; a sharded build (Init) needs Stage 3, or give Data", i, p.Name, stage)
		}
		if p.Data.count > 0 && p.Data.count != p.Count {
			return errorf(ErrParam, "parameter %d (%q) has Data of %d elements for a count of %d", i, p.Name, p.Data.count, p.Count)
		}
		if p.Data.count > 0 && p.Data.dtype != p.DType {
			return errorf(ErrDType, "parameter %d (%q): Data is %v, the parameter %v", i, p.Name, p.Data.dtype, p.DType)
		}
		if p.Frozen || p.Count == 0 {
			continue
		}
		if p.Data.count > 0 || p.Init != nil {
			with = i
		} else {
			without = i
		}
	}
	if without >= 0 && (with >= 0 || optimizer) {
		p := params[without]
		return errorf(ErrParam, "parameter %d (%q) has no memory (Data or Init) while others have, or an optimizer needs it; give every trained parameter its memory", without, p.Name)
	}
	return nil
}

// hasParamMemory reports whether the parameters were registered with memory
// (Data or Init); checkParamMemory has made it all or none.
func hasParamMemory(params []Param) bool {
	for _, p := range params {
		if !p.Frozen && p.Count > 0 && (p.Data.count > 0 || p.Init != nil) {
			return true
		}
	}
	return false
}
