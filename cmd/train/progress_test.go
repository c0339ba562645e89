package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"zero"
)

// readMetrics parses a -metrics file: one JSON object a line, each with
// exactly the columns stepMetrics names, every value a scalar (a number,
// a bool or null), so that a table reader takes each key as a column.
func readMetrics(t *testing.T, path string) []stepMetrics {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	columns := []string{"grad_norm", "loss", "loss_scale", "lr", "samples_per_sec", "skipped", "step"}
	var rows []stepMetrics
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		var raw map[string]any
		if err := json.Unmarshal(sc.Bytes(), &raw); err != nil {
			t.Fatalf("line %d %q: %v", len(rows)+1, sc.Text(), err)
		}
		var keys []string
		for k, v := range raw {
			keys = append(keys, k)
			switch v.(type) {
			case float64, bool, nil:
			default:
				t.Fatalf("line %d: %s is %T, not a scalar", len(rows)+1, k, v)
			}
		}
		slices.Sort(keys)
		if !slices.Equal(keys, columns) {
			t.Fatalf("line %d has columns %q, want %q", len(rows)+1, keys, columns)
		}
		var m stepMetrics
		dec := json.NewDecoder(bytes.NewReader(sc.Bytes()))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&m); err != nil {
			t.Fatalf("line %d: %v", len(rows)+1, err)
		}
		rows = append(rows, m)
	}
	if !bytes.HasSuffix(data, []byte("\n")) {
		t.Fatalf("%s does not end its last line", path)
	}
	return rows
}

// checkMetrics holds rows to the run's own record from its first step on:
// each value is the one the engine's Stats and the loss all-reduce gave
// (a non-finite loss or norm null), the throughput the global batch over
// the step's wall time.
func checkMetrics(t *testing.T, what string, rows []stepMetrics, res result, batch int) {
	t.Helper()
	if len(rows) != len(res.loss) {
		t.Fatalf("%s: %d lines for %d steps", what, len(rows), len(res.loss))
	}
	same := func(got *float64, want float64) bool {
		if math.IsInf(want, 0) || math.IsNaN(want) {
			return got == nil
		}
		return got != nil && *got == want
	}
	for i, m := range rows {
		s := res.stats[i]
		if m.Step != res.first+i+1 || !same(m.Loss, res.loss[i]) || m.LossScale != s.LossScale || m.Skipped != s.Skipped || !same(m.GradNorm, s.GradNorm) {
			t.Fatalf("%s: line %d is %+v; the run's step %d had loss %v, scale %v, skipped %v, norm %v",
				what, i+1, m, res.first+i+1, res.loss[i], s.LossScale, s.Skipped, s.GradNorm)
		}
		if len(s.LR) != 2 || m.LR != s.LR[0] || s.LR[1] != s.LR[0] {
			t.Fatalf("%s: step %d: lr %v; the engine's groups had %v", what, m.Step, m.LR, s.LR)
		}
		if want := float64(batch) / res.wall[i].Seconds(); m.SamplesPerSec != want {
			t.Fatalf("%s: step %d: %v samples/s; %d samples in %v is %v", what, m.Step, m.SamplesPerSec, batch, res.wall[i], want)
		}
	}
}

// TestMetrics: -metrics writes every step as a JSON line whose values are
// the run's own (fp16 with skipped steps, whose norm is null, and a
// WarmupLR schedule, whose rate moves); printed lines come every
// -log-every steps and at the last, with the same values; a resumed run
// appends its steps, and the file then reads as the uninterrupted run's.
func TestMetrics(t *testing.T) {
	seed := testSeed(t)
	c := resumeCase(seed, zero.FP16, 2, false)
	c.deepspeed = writeConfig(t, `{"zero_optimization": {"stage": 2, "reduce_bucket_size": 64}, "train_batch_size": 24,
		"gradient_accumulation_steps": 2, "fp16": {"enabled": true, "initial_scale_power": 11, "loss_scale_window": 2},
		"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
		"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 6}}}`)
	c.logEvery = 5
	c.metrics = filepath.Join(t.TempDir(), "metrics.jsonl")
	var out bytes.Buffer
	straight, err := run(&out, c)
	if err != nil {
		t.Fatal(err)
	}
	rows := readMetrics(t, c.metrics)
	checkMetrics(t, "the whole run", rows, straight, c.batch)
	skipped, rates := 0, map[float64]bool{}
	for _, m := range rows {
		if m.Skipped {
			skipped++
		}
		rates[m.LR] = true
	}
	if skipped == 0 || len(rates) < 3 {
		t.Fatalf("%d skipped steps, rates %v: the run covers neither a null norm nor a schedule", skipped, rates)
	}
	// the printed lines: steps 5, 10 and the last, 12, with the run's values
	var want []string
	for i, s := range straight.stats {
		if st := i + 1; st%5 == 0 || st == c.steps {
			line := fmt.Sprintf("step %2d  loss %.4f  lr %.4g  scale %g", st, straight.loss[i], s.LR[0], s.LossScale)
			if s.Skipped {
				line += "  skipped: overflow"
			}
			want = append(want, line+fmt.Sprintf("  norm %.4g  N samples/s\n", s.GradNorm))
		}
	}
	if got := lossLines(out.String()); !slices.Equal(got, want) || len(got) != 3 {
		t.Fatalf("printed\n%s\nwant\n%s", strings.Join(got, ""), strings.Join(want, ""))
	}

	// save after step 7, resume to 12 with the same -metrics: appended
	dir := t.TempDir()
	first := c
	first.steps, first.save, first.metrics = 7, dir, filepath.Join(t.TempDir(), "resumed.jsonl")
	if _, err := run(nil, first); err != nil {
		t.Fatal(err)
	}
	second := c
	second.resume, second.metrics = dir, first.metrics
	resumed, err := run(nil, second)
	if err != nil {
		t.Fatal(err)
	}
	both := readMetrics(t, first.metrics)
	checkMetrics(t, "the resumed run", both[7:], resumed, c.batch)
	if len(both) != len(rows) {
		t.Fatalf("the saved and resumed runs wrote %d lines, the uninterrupted one %d", len(both), len(rows))
	}
	for i := range rows {
		a, b := rows[i], both[i]
		a.SamplesPerSec, b.SamplesPerSec = 0, 0
		if fmt.Sprint(a.Step, *a.Loss, a.LR, a.LossScale, a.Skipped, a.GradNorm == nil) != fmt.Sprint(b.Step, *b.Loss, b.LR, b.LossScale, b.Skipped, b.GradNorm == nil) ||
			a.GradNorm != nil && *a.GradNorm != *b.GradNorm {
			t.Fatalf("step %d: %+v after a resume, %+v uninterrupted", a.Step, b, a)
		}
	}
}

// TestLogEvery: the DeepSpeed config's steps_per_print sets how often a
// step is printed unless -log-every is given; the last step always is.
func TestLogEvery(t *testing.T) {
	for _, v := range []struct {
		file, flag int
		want       []int
	}{{0, 0, []int{1, 2, 3, 4, 5, 6, 7}}, {3, 0, []int{3, 6, 7}}, {3, 2, []int{2, 4, 6, 7}}, {0, 4, []int{4, 7}}} {
		c := defaultConfig()
		c.steps, c.logEvery = 7, v.flag
		ds := `{"zero_optimization": {"stage": 2}, "train_batch_size": 24}`
		if v.file > 0 {
			ds = fmt.Sprintf(`{"zero_optimization": {"stage": 2}, "train_batch_size": 24, "steps_per_print": %d}`, v.file)
		}
		c.deepspeed = writeConfig(t, ds)
		var out bytes.Buffer
		if _, err := run(&out, c); err != nil {
			t.Fatal(err)
		}
		var got []int
		for _, l := range lossLines(out.String()) {
			var st int
			if _, err := fmt.Sscanf(l, "step %d", &st); err != nil {
				t.Fatalf("%q: %v", l, err)
			}
			got = append(got, st)
		}
		if !slices.Equal(got, v.want) {
			t.Errorf("steps_per_print %d, -log-every %d: printed steps %v, want %v", v.file, v.flag, got, v.want)
		}
	}
}

// stepWatch is an output that, at each step line, looks at the checkpoint
// directory of a run that saves after every step: the step's checkpoint
// is there and the next one's is not yet, so the line came as the step
// ended, not after the run.
type stepWatch struct {
	t    *testing.T
	dir  string
	seen []int
	buf  bytes.Buffer
}

func (w *stepWatch) Write(p []byte) (int, error) {
	w.buf.Write(p)
	var st int
	if _, err := fmt.Sscanf(string(p), "step %d ", &st); err == nil {
		_, errNow := os.Stat(filepath.Join(w.dir, fmt.Sprintf("step-%08d", st)))
		_, errNext := os.Stat(filepath.Join(w.dir, fmt.Sprintf("step-%08d", st+1)))
		if errNow != nil || !os.IsNotExist(errNext) {
			w.t.Errorf("at step %d's line: its checkpoint %v, the next one's %v", st, errNow, errNext)
		}
		w.seen = append(w.seen, st)
	}
	return len(p), nil
}

// TestPrintsAsStepsEnd: each step's line is printed when the step ends.
func TestPrintsAsStepsEnd(t *testing.T) {
	c := defaultConfig()
	c.steps, c.save, c.saveEvery, c.keep = 4, t.TempDir(), 1, 10
	w := &stepWatch{t: t, dir: c.save}
	if _, err := run(w, c); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(w.seen, []int{1, 2, 3, 4}) {
		t.Fatalf("step lines %v, want 1 to 4:\n%s", w.seen, w.buf.String())
	}
}

// TestMetricsFileErrors: a -metrics path that cannot be written fails the
// run before it trains, naming the flag.
func TestMetricsFileErrors(t *testing.T) {
	c := defaultConfig()
	c.metrics = filepath.Join(t.TempDir(), "no", "such", "dir", "m.jsonl")
	if _, err := run(nil, c); err == nil || !strings.Contains(err.Error(), "-metrics") {
		t.Fatalf("%v, want an error naming -metrics", err)
	}
}
