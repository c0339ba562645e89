package deepspeed

import (
	"encoding/json"
	"fmt"

	"zero"
)

// A DeepSpeed checkpoint's state as a zero checkpoint: zero.WriteCheckpoint
// writes it, and Engine.Load reshards it into an engine of any world size,
// stage and bucket size, as it does a checkpoint zero saved.

// ClientState is what WriteZero records as the checkpoint's client bytes
// (those Engine.Load returns on rank 0), as JSON: the counters DeepSpeed's
// engine restores beside the optimizer, for a trainer that continues the
// run (cmd/train -resume reads them).
type ClientState struct {
	DeepSpeed     string `json:"deepspeed"`      // the version that wrote the checkpoint
	GlobalSteps   int    `json:"global_steps"`   // steps taken, skipped ones included
	GlobalSamples int    `json:"global_samples"` // samples consumed
	SkippedSteps  int    `json:"skipped_steps"`  // steps skipped on overflow
}

// ZeroState is s in zero's terms, for zero.WriteCheckpoint: every
// parameter (the frozen ones with no values: a zero checkpoint holds
// none, the engine has them in Param.Data) in s's order, with its master,
// moments, model-dtype value and step count; the groups as zero.AdamW,
// each with the config's optimizer.params.lr where a scheduler runs (the
// base rate zero's schedules work from; DeepSpeed's groups hold the
// scheduled one); the steps taken (global_steps) and the schedule's t
// (last_batch_iteration + 1, or the steps applied where there is no
// scheduler); the loss scaler's state. Refused (ErrUnsupported): a
// dynamic scaler zero's does not follow step for step (consecutive
// hysteresis, a factor other than 2) or a dtype zero does not train in.
func ZeroState(s *State) (zero.CheckpointState, error) {
	var st zero.CheckpointState
	model, ok := s.ModelDType.Zero()
	if !ok {
		return st, errorf(ErrUnsupported, s.Dir, "the model dtype %v: zero trains in float32, bfloat16 and float16", s.ModelDType)
	}
	if sc := s.Scaler; sc.Dynamic && (sc.Consecutive || sc.Factor != 2) {
		return st, errorf(ErrUnsupported, s.Dir, "a dynamic loss scaler with consecutive_hysteresis %v and scale_factor %v: zero's scaler gives the hysteresis back only when it doubles, and halves and doubles", sc.Consecutive, sc.Factor)
	}
	baseLR, scheduled := -1.0, false
	if s.Scheduler.Type != "" {
		scheduled = true
		var cfg struct {
			Optimizer struct {
				Params struct {
					LR *float64 `json:"lr"`
				} `json:"params"`
			} `json:"optimizer"`
		}
		if json.Unmarshal(s.Config, &cfg) == nil && cfg.Optimizer.Params.LR != nil {
			baseLR = *cfg.Optimizer.Params.LR
		}
	}
	for _, g := range s.Groups {
		a := g.AdamW
		if baseLR >= 0 {
			a.LR = baseLR
		}
		st.Groups = append(st.Groups, a)
	}
	for _, p := range s.Params {
		q := zero.Param{Name: p.Name, Count: numel(p.Shape), Shape: p.Shape, DType: model, Group: max(p.Group, 0), Frozen: p.Frozen}
		st.Params = append(st.Params, q)
		if p.Frozen || q.Count == 0 {
			st.Values = append(st.Values, zero.ParamState{})
			continue
		}
		v := zero.ParamState{Master: p.Master, M: p.ExpAvg, V: p.ExpAvgSq, Steps: p.Step}
		if d, _ := p.Model.DType.Zero(); d != model || p.Model.Numel() != q.Count {
			return st, errorf(ErrInconsistent, s.Dir, "parameter %s holds %d %v values in the model, the checkpoint's master %d of a %v model", p.Name, p.Model.Numel(), p.Model.DType, q.Count, s.ModelDType)
		}
		if model == zero.FP32 {
			x, _ := p.Model.Float32s()
			v.Model = zero.Float32s(x)
		} else {
			h, _ := p.Model.Uint16s()
			v.Model = zero.Halfs(h, model)
		}
		st.Values = append(st.Values, v)
	}
	st.Step = s.GlobalSteps
	st.Scheduled = s.GlobalSteps - s.SkippedSteps
	if scheduled {
		st.Scheduled = s.Scheduler.LastBatchIteration + 1
	}
	st.Stage = s.Stage
	sc := s.Scaler
	st.LossScale = zero.LossScaleState{Scale: sc.Scale, CurHysteresis: sc.CurHysteresis, Iter: sc.Iter, LastOverflow: sc.LastOverflow}
	if !sc.Dynamic {
		st.LossScale.LastOverflow = -1 // a static scale keeps no overflow
	}
	return st, nil
}

// WriteZero writes s as a zero checkpoint into dir (zero.WriteCheckpoint):
// dir/step-N (N the steps DeepSpeed took) and dir/latest, with rank 0's
// client bytes the ClientState of s, as JSON. A refusal of ZeroState, or
// of zero's checks (zero's error, wrapped), leaves dir as it was.
func WriteZero(s *State, dir string) error {
	st, err := ZeroState(s)
	if err != nil {
		return err
	}
	client, _ := json.Marshal(ClientState{DeepSpeed: s.DSVersion, GlobalSteps: s.GlobalSteps, GlobalSamples: s.GlobalSamples, SkippedSteps: s.SkippedSteps})
	if err := zero.WriteCheckpoint(dir, st, zero.SaveOptions{Client: client}); err != nil {
		return fmt.Errorf("deepspeed: writing the zero checkpoint %s: %w", dir, err) // zero's kind: errors.Is finds it
	}
	return nil
}
