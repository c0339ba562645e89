package deepspeed

import (
	"encoding/json"
	"slices"
)

// FP32Tensors is the state_dict zero_to_fp32.py (0.19.8) makes of the
// checkpoint, with its names: the buffers (floating ones as fp32), the
// frozen parameters the checkpoint lists in frozen_param_shapes (stage 2
// lists them, stage 1 does not) as fp32, the trainable parameters' fp32
// master weights, and each tied name a copy of the tensor it shares.
func FP32Tensors(s *State) []NamedTensor {
	var out []NamedTensor
	index := map[string]int{}
	add := func(t NamedTensor) {
		index[t.Name] = len(out)
		out = append(out, t)
	}
	for _, b := range s.Buffers {
		add(NamedTensor{b.Name, asFP32(b.Tensor)})
	}
	if s.frozenListed {
		for _, p := range s.Params {
			if p.Frozen {
				add(NamedTensor{p.Name, asFP32(p.Model)})
			}
		}
	}
	for _, p := range s.Params {
		if !p.Frozen {
			add(NamedTensor{p.Name, Tensor{Float32, slices.Clone(p.Shape), float32Bytes(p.Master)}})
		}
	}
	for _, alias := range sortedKeys(s.Shared) {
		if i, ok := index[s.Shared[alias]]; ok {
			t := out[i].Tensor
			add(NamedTensor{alias, Tensor{t.DType, t.Shape, slices.Clone(t.Data)}})
		}
	}
	return out
}

// asFP32 is t as fp32 if it is floating-point, else t (PyTorch's
// `v.float() if v.is_floating_point() else v`).
func asFP32(t Tensor) Tensor {
	if !t.DType.Floating() || t.DType == Float32 {
		return t
	}
	x, _ := t.Float32s()
	return Tensor{Float32, t.Shape, float32Bytes(x)}
}

// OptimizerTensors are the trainable parameters' Adam state, named as
// torch names it and as zero's own export (ExportOptions.Optimizer) does:
// NAME.exp_avg, NAME.exp_avg_sq and NAME.step (a float32 scalar); and
// metadata that records each group's hyperparameters, step and
// parameters (key "deepspeed_optimizer", JSON).
func OptimizerTensors(s *State) ([]NamedTensor, map[string]string) {
	var out []NamedTensor
	type group struct {
		LR          float64    `json:"lr"`
		Betas       [2]float64 `json:"betas"`
		Eps         float64    `json:"eps"`
		WeightDecay float64    `json:"weight_decay"`
		Step        int        `json:"step"`
		Params      []string   `json:"params"`
	}
	groups := make([]group, len(s.Groups))
	for i, g := range s.Groups {
		groups[i] = group{LR: g.AdamW.LR, Betas: [2]float64{g.AdamW.Beta1, g.AdamW.Beta2}, Eps: g.AdamW.Eps,
			WeightDecay: g.AdamW.WeightDecay, Step: g.Step}
	}
	for _, p := range s.Params {
		if p.Frozen {
			continue
		}
		out = append(out,
			NamedTensor{p.Name + ".exp_avg", Tensor{Float32, slices.Clone(p.Shape), float32Bytes(p.ExpAvg)}},
			NamedTensor{p.Name + ".exp_avg_sq", Tensor{Float32, slices.Clone(p.Shape), float32Bytes(p.ExpAvgSq)}},
			NamedTensor{p.Name + ".step", Tensor{Float32, []int{}, float32Bytes([]float32{float32(p.Step)})}})
		groups[p.Group].Params = append(groups[p.Group].Params, p.Name)
	}
	meta, _ := json.Marshal(map[string]any{"type": "AdamW", "groups": groups})
	return out, map[string]string{"deepspeed_optimizer": string(meta)}
}
