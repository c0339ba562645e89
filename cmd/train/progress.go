package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"

	"zero"
)

// progress reports a run on rank 0 as it goes: a line for every every-th
// step (and the last) to out as the step ends, and one JSON object a line
// for every step to metrics, which pandas (read_json(lines=True)) or any
// plotting tool reads. A nil *progress reports nothing.
type progress struct {
	out     io.Writer // nil: no lines
	metrics io.Writer // nil: no JSON lines
	every   int       // a line every so many steps
	last    int       // the run's last step, always printed
	batch   int       // samples per step, over every rank
}

// stepMetrics is one step as the JSON lines write it: flat scalars, one
// column each. A non-finite loss or norm (a skipped step's) is null.
type stepMetrics struct {
	Step          int      `json:"step"`       // from 1
	Loss          *float64 `json:"loss"`       // the global batch's mean, before the step
	LR            float64  `json:"lr"`         // the step's learning rate (both groups share it)
	LossScale     float64  `json:"loss_scale"` // the scale the step's gradients carried
	Skipped       bool     `json:"skipped"`
	GradNorm      *float64 `json:"grad_norm"` // before clipping, unscaled
	SamplesPerSec float64  `json:"samples_per_sec"`
}

func finite(x float64) *float64 {
	if math.IsInf(x, 0) || math.IsNaN(x) {
		return nil
	}
	return &x
}

// metricsOf is step st's (from 0) record: its loss, the engine's stats
// and its wall time.
func metricsOf(st int, loss float64, s zero.Stats, wall time.Duration, batch int) stepMetrics {
	m := stepMetrics{Step: st + 1, Loss: finite(loss), LossScale: s.LossScale, Skipped: s.Skipped, GradNorm: finite(s.GradNorm)}
	if len(s.LR) > 0 {
		m.LR = s.LR[0]
	}
	if wall > 0 {
		m.SamplesPerSec = float64(batch) / wall.Seconds()
	}
	return m
}

// begin reports where the run starts: the engine's settings when they
// come from a DeepSpeed config, the checkpoint a resumed run continues
// (loaded) and, in one line, what its load resharded.
func (p *progress) begin(c config, first int, settings []zero.Setting, loaded *zero.LoadReport) {
	if p == nil || p.out == nil {
		return
	}
	if c.ds != nil {
		printSettings(p.out, settings)
	}
	if c.resume != "" {
		fmt.Fprintf(p.out, "resumed from %s after step %d\n", c.resume, first)
	}
	if line := reshardLine(loaded); line != "" {
		fmt.Fprintln(p.out, line)
	}
}

// reshardLine is what a load changed of the checkpoint's layout and batch
// split, in one line ("" where it changed nothing).
func reshardLine(r *zero.LoadReport) string {
	if r == nil {
		return ""
	}
	var parts []string
	for _, ch := range r.Changed {
		switch ch.Path {
		case "World", "Stage", "BucketBytes", "Align", "Grads.AccumSteps", "Window.DType":
			parts = append(parts, fmt.Sprintf("%s %s → %s", ch.Path, ch.Saved, ch.Engine))
		}
	}
	if r.Reshard.Buckets {
		parts = append(parts, "buckets regrouped")
	}
	if n := len(r.Reshard.Params); n > 0 {
		parts = append(parts, fmt.Sprintf("%d parameters placed anew", n))
	}
	if len(parts) == 0 {
		return ""
	}
	return "resharded the checkpoint of step " + strconv.Itoa(r.Step) + ": " + strings.Join(parts, ", ")
}

// stepEnded reports step st (from 0).
func (p *progress) stepEnded(st int, loss float64, s zero.Stats, wall time.Duration) error {
	if p == nil {
		return nil
	}
	m := metricsOf(st, loss, s, wall, p.batch)
	if p.out != nil && (m.Step%p.every == 0 || m.Step == p.last) {
		fmt.Fprintf(p.out, "step %2d  loss %.4f  lr %.4g  scale %g", m.Step, loss, m.LR, m.LossScale)
		if m.Skipped { // only fp16 goes on after a skip: its scaled gradients overflowed
			fmt.Fprint(p.out, "  skipped: overflow")
		}
		fmt.Fprintf(p.out, "  norm %.4g  %.0f samples/s\n", s.GradNorm, m.SamplesPerSec)
	}
	if p.metrics != nil {
		line, err := json.Marshal(m)
		if err != nil {
			return err
		}
		if _, err := p.metrics.Write(append(line, '\n')); err != nil {
			return fmt.Errorf("-metrics: %w", err)
		}
	}
	return nil
}

// saved reports a checkpoint written after step st (from 1).
func (p *progress) saved(st int, dir string) {
	if p != nil && p.out != nil {
		fmt.Fprintf(p.out, "checkpoint of step %d saved in %s\n", st, dir)
	}
}
