package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"zero"
)

// TestDeepSpeedFormulas: DeepSpeed's estimators and the paper's formulas
// at Ψ = 10⁹, a largest layer of 10⁸, 8 GPUs a node, worked by hand from
// estimate_zero2_model_states_mem_needs and
// estimate_zero3_model_states_mem_needs (zero_init, additional_buffer_factor
// 1.5; cpu_offload_params with the optimizer offloaded, and ignored without
// it, as its source has it).
func TestDeepSpeedFormulas(t *testing.T) {
	params, err := zero.CountParams(1e9, 1e8, zero.BF16)
	if err != nil {
		t.Fatal(err)
	}
	m := model{params: params, total: 1e9, largest: 1e8}
	for _, c := range []struct {
		stage, world    int
		offload, params bool
		gpu, cpu        int64
	}{
		{1, 8, false, false, 4e9 + 1.5e9, 0},      // 2Ψ + 2Ψ + 12Ψ/N
		{1, 8, true, false, 4e9, 0},               // the K term on the host
		{2, 8, false, false, 2e9 + 2.25e9, 48e9},  // 2Ψ + 18Ψ/N; Ψ·4·8·1.5
		{2, 8, true, false, 2e9, 48e9},            // 2Ψ; Ψ·max(4·8, 16)·1.5
		{2, 16, true, false, 2e9, 96e9},           // Ψ·max(4·16, 16)·1.5 per node
		{2, 2, true, false, 2e9, 24e9},            // Ψ·max(4·2, 16)·1.5
		{3, 8, false, false, 4e8 + 2.25e9, 4.8e9}, // 4·LL + 18Ψ/N; LL·4·8·1.5
		{3, 8, true, false, 4e8 + 2.5e8, 24e9},    // 4·LL + 2Ψ/N; 16Ψ/nodes·1.5
		{3, 16, true, false, 4e8 + 1.25e8, 12e9},  // two nodes
		{3, 8, true, true, 4e8, 27e9},             // offload_param: 4·LL; 18Ψ/nodes·1.5
		{3, 64, true, true, 4e8, 27e8 * 10 / 8},   // eight nodes: 18Ψ/8·1.5
		{3, 8, false, true, 4e8 + 2.25e9, 4.8e9},  // offload_param alone: as without it
	} {
		cfg := zero.Config{Stage: c.stage}
		cfg.Offload.Optimizer, cfg.Offload.Params = c.offload, c.params
		f := deepspeed(m, cfg, c.world, 8)
		if f.gpu != c.gpu || f.cpu != c.cpu {
			t.Errorf("stage %d W=%d offload %v: DeepSpeed GPU %d CPU %d, want %d and %d", c.stage, c.world, c.offload, f.gpu, f.cpu, c.gpu, c.cpu)
		}
		sum := int64(0)
		for _, b := range f.parts {
			sum += b
		}
		if sum != f.gpu {
			t.Errorf("stage %d W=%d offload %v: parts %v sum to %d, not the figure %d", c.stage, c.world, c.offload, f.parts, sum, f.gpu)
		}
	}
	for _, c := range []struct {
		stage           int
		offload, params bool
		want            int64
	}{{1, false, false, 5.5e9}, {2, false, false, 2e9 + 1.75e9}, {3, false, false, 2e9}, {3, true, false, 0.5e9}, {3, true, true, 0.25e9}, {3, false, true, 1.75e9}} {
		if got, _ := paper(1e9, c.stage, 8, c.offload, c.params); got != c.want {
			t.Errorf("paper stage %d offload %v params %v: %d, want %d", c.stage, c.offload, c.params, got, c.want)
		}
	}
	// the paper's volumes: 2Ψ, (g+1)Ψ, 3gΨ elements of 2 bytes, (W−1)/W
	for stage, want := range map[int]int64{1: 2 * 2e9 * 7 / 8, 2: 5 * 2e9 * 7 / 8, 3: 12 * 2e9 * 7 / 8} {
		if got := paperWire(1e9, 2, stage, 8, 4); got != want {
			t.Errorf("paper wire stage %d: %d, want %d", stage, got, want)
		}
	}
}

// jsonRows runs the command with -json and decodes its rows.
func jsonRows(t *testing.T, args ...string) []Row {
	t.Helper()
	var out bytes.Buffer
	if err := run(append(args, "-json"), &out); err != nil {
		t.Fatal(err)
	}
	var rows []Row
	sc := bufio.NewScanner(&out)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r Row
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("%v: %s", err, sc.Bytes())
		}
		rows = append(rows, r)
	}
	return rows
}

// TestTable7B70B: the default table (7B and 70B, W = 8…1024, stages 1-3,
// with and without offload and a window) holds its target on every row:
// zero's model states at most DeepSpeed's, or every kind it holds more of
// named; and its figures keep the closed forms of the engine's rules, up
// to the shards' padding (at most Align = 64 elements a bucket per rank):
// stage 1 2Ψ + 4Ψ + 18Ψ/W, stage 2 2Ψ + 18Ψ/W, stage 3 18Ψ/W and two
// largest-layer gather buffers, with offload only the parameters on the
// device, a window 4Ψ of fp32 sums at stages 2 and 3; the wire per step
// the paper's volumes (stage 3 up to 2% more, for buckets that several
// parameters gathered one at a time share), a window's reduce-scatters
// once per step.
func TestTable7B70B(t *testing.T) {
	rows := jsonRows(t)
	if len(rows) != 2*8*3*2*2 {
		t.Fatalf("%d rows, want 2 models × 8 W × 3 stages × offload × window", len(rows))
	}
	for _, r := range rows {
		what := func() string {
			b, _ := json.Marshal(r)
			return string(b)
		}
		if !r.Named {
			t.Errorf("target missed: %s", what())
		}
		psi, n := float64(r.Params), float64(r.World)
		want := map[int]float64{1: 6*psi + 18*psi/n, 2: 2*psi + 18*psi/n, 3: 18*psi/n + 4*float64(r.Largest)}[r.Stage]
		if r.Offload {
			want = map[int]float64{1: 6*psi + 2*psi/n, 2: 2*psi + 2*psi/n, 3: 2*psi/n + 4*float64(r.Largest)}[r.Stage]
		}
		if r.Window && r.Stage > 1 {
			want += 4 * psi
		}
		// per rank, each bucket pads by under 64 elements of every
		// per-element kind (≤ 18 bytes), and a window's sums by under 64·W
		// elements of 4 bytes
		pad := float64(r.Buckets) * 64 * (18 + 4*n)
		if got := float64(r.ModelStates); got < want || got > want+pad {
			t.Errorf("model states %.0f, closed form %.0f (+ padding ≤ %.0f): %s", got, want, pad, what())
		}
		// the wire: reduce-scatters once per step at stage 1 and in a
		// window, every backward otherwise; the new parameters' all-gather
		// once per step at stages 1-2; at stage 3 two gathers of every
		// bucket per backward, and more where a bucket holds several
		// parameters gathered one at a time (at most 2% more here)
		g, ring := 4.0, 2*psi*(n-1)/n
		rs := map[bool]float64{false: g, true: 1}[r.Stage == 1 || r.Window]
		padWire := float64(r.Buckets) * 64 * n * 2 // a bucket's padding, in bytes of the payload
		if got := float64(r.Wire.ReduceScatterBytes); got < rs*ring || got > rs*(ring+padWire) {
			t.Errorf("reduce-scatter wire %.0f, want %.0f × %.0f (+ padding): %s", got, rs, ring, what())
		}
		ag, slack := 1.0, 1.0
		if r.Stage == 3 {
			ag, slack = 2*g, 1.02
		}
		if got := float64(r.Wire.AllGatherBytes); got < ag*ring || got > ag*(ring+padWire)*slack+1e6 {
			t.Errorf("all-gather wire %.0f, want %.0f × %.0f (+ padding): %s", got, ag, ring, what())
		}
		if !r.Window && (r.Wire.Total < r.PaperWire || float64(r.Wire.Total) > float64(r.PaperWire)*1.02+1e6) {
			t.Errorf("wire %d, the paper's %d: %s", r.Wire.Total, r.PaperWire, what())
		}
	}
}

// TestTablesPrint: the long and the wide tables carry a row per
// configuration, the codes of the differences and their legend, and no
// unexplained difference.
func TestTablesPrint(t *testing.T) {
	var long, wide bytes.Buffer
	args := []string{"-model", "7b", "-world", "8,64"}
	if err := run(args, &long); err != nil {
		t.Fatal(err)
	}
	if err := run(append(args, "-wide"), &wide); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## 7B", "| 8 | 1 | no | no |", "| 64 | 3 | yes | yes |", "2Ψ + 18Ψ/N", "4·LL + 2Ψ/N", "- N: ", "- W: ", "- L: "} {
		if !strings.Contains(long.String(), want) {
			t.Errorf("the long table has no %q:\n%s", want, long.String())
		}
	}
	for _, want := range []string{"| stage | offload | window | W=8 | W=64 |", "| 3 | no | no | 14.6 / 14.6 |", "| 2 | yes | yes |"} {
		if !strings.Contains(wide.String(), want) {
			t.Errorf("the wide table has no %q:\n%s", want, wide.String())
		}
	}
	if strings.Contains(long.String(), "?") || strings.Contains(wide.String(), "?") {
		t.Errorf("a difference without its reason:\n%s", long.String())
	}
}

// TestOptions: a model known by its size, 16-bit sums, a budget and the
// other optimizers estimate; what is wrong is refused with the flag named.
func TestOptions(t *testing.T) {
	rows := jsonRows(t, "-params", "7e9", "-largest", "1.31e8", "-world", "8", "-shard-dtype", "bf16", "-window-dtype", "bf16",
		"-window-budget", "1GiB", "-optimizer", "sgd-momentum", "-gather", "block", "-comm-dtype", "fp32")
	if len(rows) != 12 || rows[0].Params != 7e9 || rows[0].Largest != 1.31e8 {
		t.Fatalf("%d rows, the first %+v", len(rows), rows[0])
	}
	for _, r := range rows {
		if r.Window && r.Stage > 1 && (r.Device.WindowSums > 1<<30 || r.Device.WindowSums == 0) {
			t.Errorf("stage %d: window sums %d, want some within the 1 GiB budget", r.Stage, r.Device.WindowSums)
		}
		if r.Device.OptimizerState+r.Host.OptimizerState != r.Device.Master+r.Host.Master {
			t.Errorf("SGD with momentum: state %d, want one fp32 buffer as the master's %d", r.Device.OptimizerState+r.Host.OptimizerState, r.Device.Master+r.Host.Master)
		}
	}
	for _, args := range [][]string{
		{"-world", "0"}, {"-world", "x"}, {"-stages", ""}, {"-offload", "maybe"}, {"-dtype", "fp8"}, {"-bucket", "3XB"},
		{"-params", "7e9"}, {"-params", "1e6", "-largest", "2e6"}, {"-optimizer", "adam"}, {"-gather", "layer"},
		{"-model", "1t"}, {"-backwards", "0"}, {"stray"}, {"-stages", "4"}, {"-shard-dtype", "fp16"},
	} {
		var out bytes.Buffer
		if err := run(args, &out); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
}

// TestDeepSpeedConfig: -deepspeed estimates the user's model under a
// published config (LLaMA-Factory's ZeRO-3, bf16, its "auto" buckets filled
// from -hidden as the Trainer fills them) row for row as the flags that
// say the same do; it prints the config's notices and what filled each
// "auto"; and a config zero refuses, a flag the config decides, and an
// "auto" bucket without a hidden size are errors that say so.
func TestDeepSpeedConfig(t *testing.T) {
	file := "../../testdata/deepspeed/llamafactory_ds_z3_config.json"
	h := 4096
	got := jsonRows(t, "-deepspeed", file, "-params", "7e9", "-largest", "1.31e8", "-hidden", fmt.Sprint(h), "-world", "8,16")
	want := jsonRows(t, "-params", "7e9", "-largest", "1.31e8", "-world", "8,16", "-stages", "3", "-offload", "off", "-window", "off",
		"-dtype", "bf16", "-shard-dtype", "bf16", "-bucket", fmt.Sprint(h*h*2), "-prefetch", fmt.Sprint(int(0.9*float64(h*h))*2),
		"-live", fmt.Sprint(int(1e9)*2), "-backwards", "4")
	if len(got) != 2 || !reflect.DeepEqual(got, want) {
		t.Errorf("from the DeepSpeed config:\n%+v\nfrom the flags that say the same:\n%+v", got, want)
	}
	var out bytes.Buffer
	if err := run([]string{"-deepspeed", file, "-model", "7b", "-world", "8"}, &out); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"notice zero_optimization.sub_group_size", "notice zero_optimization.stage3_max_reuse_distance",
		`"auto" zero_optimization.reduce_bucket_size filled with 16777216`, "| 8 | 3 | no | no |"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("no %q in the output:\n%s", s, out.String())
		}
	}
	// offload_param {device: cpu} at stage 3: the rows offload the parameters
	for _, r := range jsonRows(t, "-deepspeed", "../../testdata/deepspeed/hf_docs_zero3.json", "-model", "7b", "-world", "8") {
		if r.Stage != 3 || !r.Offload || !r.OffloadParams {
			t.Errorf("hf_docs_zero3.json: stage %d, offload %v, parameter offload %v; want 3, both offloaded", r.Stage, r.Offload, r.OffloadParams)
		}
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-deepspeed", "../../testdata/deepspeed/hf_docs_zero3_nvme.json", "-model", "7b"}, "zero_optimization.offload_param.device"},
		{[]string{"-deepspeed", file, "-model", "7b", "-offload-params", "on"}, "-offload-params with -deepspeed"},
		{[]string{"-deepspeed", file, "-model", "7b", "-stages", "2"}, "-stages with -deepspeed"},
		{[]string{"-deepspeed", file, "-params", "7e9", "-largest", "1.31e8"}, "give -hidden"},
		{[]string{"-hidden", "4096"}, "give it with -deepspeed"},
		{[]string{"-deepspeed", "missing.json"}, "-deepspeed"},
	} {
		var out bytes.Buffer
		if err := run(c.args, &out); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want an error with %q", c.args, err, c.want)
		}
	}
}

// TestTableParamOffload: the stage-3 rows with the parameters offloaded
// (7B and 70B at W = 8 and 64, the optimizer on the device and offloaded)
// stand beside DeepSpeed's estimate with offload_param, hold its target,
// and keep the closed forms: the device keeps no parameter shard, so its
// model states are the row without parameter offload less 2Ψ/W, the
// host's bytes more by as much (with the optimizer offloaded the host's
// copy of the new parameters goes, the shard taking its place).
func TestTableParamOffload(t *testing.T) {
	rows := jsonRows(t, "-stages", "3", "-world", "8,64", "-offload-params", "off,on", "-window", "off")
	if len(rows) != 2*2*2*2 {
		t.Fatalf("%d rows, want 2 models × 2 W × optimizer offload × parameter offload", len(rows))
	}
	for _, r := range rows {
		if !r.OffloadParams {
			continue
		}
		b, _ := json.Marshal(r)
		var base *Row
		for i := range rows {
			if q := &rows[i]; q.Model == r.Model && q.World == r.World && q.Offload == r.Offload && !q.OffloadParams {
				base = q
			}
		}
		if base == nil || !r.Named {
			t.Fatalf("no row without parameter offload, or a difference unnamed: %s", b)
		}
		shard := base.Device.ParamShard
		if shard < 2*r.Params/int64(r.World) || r.Device.ParamShard != 0 || r.Host.ParamShard != shard ||
			r.ModelStates != base.ModelStates-shard {
			t.Errorf("parameter shard %d bytes on the device, %d on the host, model states %d; without: %d, %d: %s",
				r.Device.ParamShard, r.Host.ParamShard, r.ModelStates, shard, base.ModelStates, b)
		}
		wantHost := base.HostTotal + shard
		if r.Offload {
			wantHost = base.HostTotal // the host's copy of the new parameters goes
		}
		if r.HostTotal != wantHost {
			t.Errorf("host bytes %d, want %d: %s", r.HostTotal, wantHost, b)
		}
		want := map[bool]string{true: "4·LL", false: "4·LL + 18Ψ/N (offload_param alone: its estimator ignores it)"}[r.Offload]
		if r.DeepSpeedFormula != want || r.Offload && r.DeepSpeed != 4*r.Largest {
			t.Errorf("DeepSpeed's figure %d (%s), want %s: %s", r.DeepSpeed, r.DeepSpeedFormula, want, b)
		}
	}
}
