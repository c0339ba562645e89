package deepspeed

import "zero"

// State is a DeepSpeed checkpoint's training state, per parameter: what
// a zero engine needs to continue the run, placed by name and shape,
// never by DeepSpeed's flat offsets. Its fields are those of a zero
// checkpoint (the fp32 master, the moments and step count per parameter,
// the model-dtype values, the optimizer groups as zero.AdamW, the loss
// scaler's counters, the schedule's step), so writing a zero checkpoint
// from it is a matter of zero's exported writer.
type State struct {
	Dir        string // the checkpoint's tag directory (global_stepN)
	DSVersion  string // the DeepSpeed version that wrote it
	Stage      int    // ZeRO stage: 1, 2 or 3
	World      int    // data-parallel world size it was saved at
	ModelDType DType  // the parameters' dtype in the model (float32, bfloat16, float16)

	// Params are the trainable parameters in DeepSpeed's order (group by
	// group, as param_shapes lists them), then the frozen ones.
	Params  []Param
	Buffers []NamedTensor // persistent buffers, as the module holds them
	// Shared maps a parameter name the checkpoint does not store to the
	// one it shares its tensor with (tied weights).
	Shared map[string]string

	Groups    []Group
	Scaler    LossScaler
	Scheduler Scheduler
	ClipGrad  float64 // gradient_clipping (0: none)

	GlobalSteps   int // optimizer steps the engine counted (skipped ones included)
	SkippedSteps  int // steps skipped on overflow
	GlobalSamples int

	// Config is the run's DeepSpeed config as JSON (the ds_config the
	// checkpoint carries), for zero.ReadDeepSpeed.
	Config []byte

	// zero_to_fp32 writes the frozen parameters only when the checkpoint
	// lists them in frozen_param_shapes (stage 2); FP32Tensors follows it.
	frozenListed bool
}

// Param is one parameter's state.
type Param struct {
	Name   string
	Shape  []int
	Group  int  // index into State.Groups; -1 for a frozen parameter
	Frozen bool // no optimizer state: Master, ExpAvg, ExpAvgSq are nil
	// Master is the fp32 master weight; ExpAvg and ExpAvgSq are Adam's
	// first and second moments, each numel(Shape) elements.
	Master, ExpAvg, ExpAvgSq []float32
	Step                     int    // optimizer steps this parameter has taken
	Model                    Tensor // the model-dtype value the module holds
}

// NamedTensor is a tensor and its state_dict name.
type NamedTensor struct {
	Name string
	Tensor
}

// Group is an optimizer parameter group: its hyperparameters as they
// stood at the save (the learning rate is the schedule's current one).
type Group struct {
	AdamW zero.AdamW
	Step  int // Adam's step count (torch keeps one per group's flat tensor)
}

// LossScaler is DeepSpeed's loss scaler at the save; zero's scaler has the
// same counters.
type LossScaler struct {
	Dynamic       bool
	Scale         float64 // cur_scale
	Iter          int     // cur_iter
	LastOverflow  int     // last_overflow_iter (-1: none yet)
	CurHysteresis int     // cur_hysteresis
	// the dynamic scaler's settings
	Factor      float64 // scale_factor
	Window      int     // scale_window
	MinScale    float64 // min_scale
	Hysteresis  int     // delayed_shift
	Consecutive bool    // consecutive_hysteresis
}

// Scheduler is the learning-rate schedule's position.
type Scheduler struct {
	Type string // the config's scheduler.type ("" when there is none)
	// LastBatchIteration is DeepSpeed's last_batch_iteration: the index of
	// the last step the schedule set a rate for (-1 before the first).
	LastBatchIteration int
}

// Param returns the parameter of that name.
func (s *State) Param(name string) (*Param, bool) {
	for i := range s.Params {
		if s.Params[i].Name == name {
			return &s.Params[i], true
		}
	}
	return nil, false
}
