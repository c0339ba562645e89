package main

import (
	"bytes"
	"strings"
	"testing"

	"zero"
)

func smallConfig() config {
	c := defaultConfig()
	c.steps, c.blocks, c.width, c.hidden, c.batch = 4, 3, 16, 32, 32
	return c
}

// TestExample runs the example small, every way, and requires every check
// to pass.
func TestExample(t *testing.T) {
	c := smallConfig()
	specs, err := parseSpecs("2,3", "blocks,graph")
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	ok, err := runAll(&out, c, specs)
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	if !ok {
		t.Fatal("the check failed")
	}
	for _, s := range specs {
		if !strings.Contains(out.String(), s.String()+": ok") {
			t.Errorf("no passing check for %v", s)
		}
	}
}

// TestOtherShapes: four ranks with one backward each, and one rank with
// four backwards, at stages 1, 2 and 3, block by block.
func TestOtherShapes(t *testing.T) {
	for _, tc := range []struct{ world, accum int }{{4, 1}, {1, 4}} {
		c := smallConfig()
		c.world, c.accum, c.steps = tc.world, tc.accum, 3
		specs, _ := parseSpecs("1,2,3", "blocks")
		var out bytes.Buffer
		ok, err := runAll(&out, c, specs)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			t.Fatalf("W=%d G=%d: the check failed:\n%s", tc.world, tc.accum, out.String())
		}
	}
}

// TestCheckRejects: the check fails a run whose parameters did not reach
// GoMLX (the write-back), whose one block's gradient is missing, or whose
// parameters moved a little after step 1.
func TestCheckRejects(t *testing.T) {
	c := smallConfig()
	ref, err := runReference(c)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := newEvaluator(c)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.close()
	refAt, err := evaluateAll(c, ev, ref.params)
	if err != nil {
		t.Fatal(err)
	}
	good, err := trainZero(c, runSpec{stage: 2})
	if err != nil {
		t.Fatal(err)
	}
	check := func(res run) verdict {
		zAt, err := evaluateAll(c, ev, res.params)
		if err != nil {
			t.Fatal(err)
		}
		return checkRun(c, ref, refAt, res, zAt)
	}
	if v := check(good); len(v.failures) > 0 {
		t.Fatalf("the good run fails: %v", v.failures)
	}
	clone := func(r run) run {
		out := r
		out.params = make([][][]float32, len(r.params))
		for st := range r.params {
			for _, p := range r.params[st] {
				out.params[st] = append(out.params[st], append([]float32(nil), p...))
			}
		}
		out.grads = make([][][]float32, len(r.grads))
		for st := range r.grads {
			for _, g := range r.grads[st] {
				out.grads[st] = append(out.grads[st], append([]float32(nil), g...))
			}
		}
		return out
	}
	// the write-back broken: GoMLX's variables keep their first values
	stuck := clone(good)
	for st := range stuck.params {
		stuck.params[st] = stuck.params[0]
	}
	// block 1's gradients missing on one of two ranks: half of them
	half := clone(good)
	for j := range 4 {
		for i := range half.grads[0][4+j] {
			half.grads[0][4+j][i] /= 2
		}
	}
	// one element off by an eighth of the learning rate after step 1
	nudged := clone(good)
	nudged.params[1][2][5] += float32(c.lr / 8)
	for name, r := range map[string]run{"write-back broken": stuck, "a block's gradient halved": half, "one parameter nudged": nudged} {
		if v := check(r); len(v.failures) == 0 {
			t.Errorf("%s: the check passes", name)
		} else {
			t.Logf("%s: %s", name, v.failures[0])
		}
	}
}

// TestResumeRejects: the resume check fails a resume that loads the
// weights only (AdamW's moments and step count start afresh), at stage 2
// and 3, and passes the full load on the same shape.
func TestResumeRejects(t *testing.T) {
	c := smallConfig()
	for _, stage := range []int{2, 3} {
		straight, err := trainZero(c, runSpec{stage: stage})
		if err != nil {
			t.Fatal(err)
		}
		for _, weightsOnly := range []bool{false, true} {
			spec := runSpec{stage: stage, resumeAt: c.steps / 2, load: zero.LoadOptions{WeightsOnly: weightsOnly}}
			res, err := trainZero(c, spec)
			if err != nil {
				t.Fatal(err)
			}
			fails := checkResume(straight, res)
			switch {
			case weightsOnly && len(fails) == 0:
				t.Errorf("%v, weights only: the check passes", spec)
			case weightsOnly:
				t.Logf("%v, weights only: %s", spec, fails[0])
			case len(fails) > 0:
				t.Errorf("%v: %v", spec, fails)
			}
		}
	}
}
