// Command gomlx trains a GoMLX model (pure-Go simplego backend) with zero:
// W in-process ranks, each block's gradients handed to zero as soon as the
// block's backward graph returns, two backwards per step in one coalesced
// window, zero's AdamW writing the new values into GoMLX's variables, at
// ZeRO-2 and at ZeRO-3 (each block gathered just before its forward and its
// backward), and the same model in one graph per step for comparison. It
// checks every run against GoMLX training alone on the whole batch with its
// own AdamW, prints the loss curves and what each way costs, and exits 1
// when a check fails.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"zero"
)

func main() {
	c := defaultConfig()
	flag.IntVar(&c.world, "world", c.world, "ranks in the in-process group")
	flag.IntVar(&c.accum, "accum", c.accum, "backwards per step and rank, in one coalesced window")
	flag.IntVar(&c.steps, "steps", c.steps, "optimizer steps")
	flag.IntVar(&c.batch, "batch", c.batch, "global batch: samples per step over every rank")
	flag.IntVar(&c.blocks, "blocks", c.blocks, "residual blocks")
	flag.IntVar(&c.width, "width", c.width, "width of the residual stream")
	flag.IntVar(&c.hidden, "hidden", c.hidden, "hidden units of each block")
	flag.Float64Var(&c.lr, "lr", c.lr, "AdamW learning rate")
	stages := flag.String("stages", "2,3", "ZeRO stages to run")
	modes := flag.String("modes", "blocks,graph", "blocks (block by block) and/or graph (one graph per backward)")
	flag.IntVar(&repeat, "repeat", repeat, "runs of each way, interleaved; the costs are the fastest run's (every run is checked)")
	flag.Parse()
	specs, err := parseSpecs(*stages, *modes)
	if err == nil {
		err = c.check()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gomlx:", err)
		os.Exit(2)
	}
	ok, err := runAll(os.Stdout, c, specs)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gomlx:", err)
		os.Exit(1)
	}
	if !ok {
		fmt.Fprintln(os.Stderr, "gomlx: the check failed")
		os.Exit(1)
	}
}

func parseSpecs(stages, modes string) ([]runSpec, error) {
	var specs []runSpec
	for _, m := range strings.Split(modes, ",") {
		if m != "blocks" && m != "graph" {
			return nil, fmt.Errorf("mode %q: want blocks or graph", m)
		}
		for _, s := range strings.Split(stages, ",") {
			st, err := strconv.Atoi(s)
			if err != nil || st < 1 || st > 3 {
				return nil, fmt.Errorf("stage %q: want 1, 2 or 3", s)
			}
			specs = append(specs, runSpec{stage: st, whole: m == "graph"})
		}
	}
	return specs, nil
}

// repeat is how many times runAll trains each way.
var repeat = 1

// runAll runs the reference and every spec, checks them, prints the
// curves, the checks and the costs, and says whether every check passed.
func runAll(out io.Writer, c config, specs []runSpec) (bool, error) {
	fmt.Fprintf(out, "GoMLX v0.26.0 (simplego backend, pure Go) with zero: %d residual blocks %d→%d→%d (%d parameters), "+
		"%d ranks × %d backwards of %d samples per step (global batch %d), AdamW lr %g, weight decay %g, eps %g, %d steps; %s\n",
		c.blocks, c.width, c.hidden, c.width, c.blocks*c.blockElems(), c.world, c.accum, c.micro(), c.batch,
		c.lr, c.wd, c.eps, c.steps, cpuName())
	ref, err := runReference(c)
	if err != nil {
		return false, fmt.Errorf("reference: %w", err)
	}
	ev, err := newEvaluator(c)
	if err != nil {
		return false, err
	}
	defer ev.close()
	if err := ev.rowsIdentical(); err != nil {
		return false, err
	}
	refAt, err := evaluateAll(c, ev, ref.params)
	if err != nil {
		return false, err
	}
	runs := make([]run, len(specs))
	verdicts := make([]verdict, len(specs))
	for rep := range max(repeat, 1) {
		for i, spec := range specs {
			res, err := trainZero(c, spec)
			if err != nil {
				return false, fmt.Errorf("%v: %w", spec, err)
			}
			zAt, err := evaluateAll(c, ev, res.params)
			if err != nil {
				return false, err
			}
			v := checkRun(c, ref, refAt, res, zAt)
			if rep == 0 || len(v.failures) > 0 || (len(verdicts[i].failures) == 0 && res.medianWall() < runs[i].medianWall()) {
				runs[i], verdicts[i] = res, v
			}
		}
	}
	// Each way once more, saved after half the steps and resumed in a new
	// engine and a new GoMLX model: the same run, bit for bit.
	resumed := make([][]string, len(specs))
	ckpts := make([]ckptCost, len(specs))
	if c.steps >= 2 {
		for i, spec := range specs {
			spec.resumeAt = c.steps / 2
			res, err := trainZero(c, spec)
			if err != nil {
				return false, fmt.Errorf("%v: %w", spec, err)
			}
			resumed[i], ckpts[i] = checkResume(runs[i], res), res.ckpt
		}
	}

	fmt.Fprintf(out, "\nloss per step (the reference: GoMLX alone, one process, the whole batch, its own AdamW)\n\n")
	fmt.Fprintf(out, "| step | GoMLX alone |")
	for _, r := range runs {
		fmt.Fprintf(out, " %v |", r.spec)
	}
	fmt.Fprintf(out, " largest bound |\n|--:|--:|")
	for range runs {
		fmt.Fprintf(out, "--:|")
	}
	fmt.Fprintf(out, "--:|\n")
	for st := range c.steps {
		fmt.Fprintf(out, "| %d | %.7f |", st+1, ref.loss[st])
		b := 0.0
		for i, r := range runs {
			fmt.Fprintf(out, " %.7f |", r.loss[st])
			if st < len(verdicts[i].lossBound) {
				b = max(b, verdicts[i].lossBound[st])
			}
		}
		fmt.Fprintf(out, " %.2g |\n", b)
	}

	fmt.Fprintf(out, "\ncheck (each figure: the largest difference over its bound; bounds from fp32's u = 2^-24, see check.go)\n\n")
	ok := true
	for i, v := range verdicts {
		if len(v.failures) > 0 {
			ok = false
			fmt.Fprintf(out, "%v: FAILED\n", runs[i].spec)
			for _, f := range v.failures {
				fmt.Fprintf(out, "    %s\n", f)
			}
			continue
		}
		fmt.Fprintf(out, "%v: ok: reduced gradients %.2f (against the exact gradient's worst-case bound %.1e); parameters after step 1 %.2f, after every step %.2f (largest difference %.2g, largest bound %.2g); losses %.2f\n",
			runs[i].spec, v.worstGrad, v.worstGrad64, v.worstParam1, v.worstParam, v.maxDiff, v.maxDTheta, v.worstLoss)
	}
	if c.steps >= 2 {
		for i, spec := range specs {
			spec.resumeAt = c.steps / 2
			if len(resumed[i]) > 0 {
				ok = false
				fmt.Fprintf(out, "%v: FAILED (against the run straight through)\n", spec)
				for _, f := range resumed[i] {
					fmt.Fprintf(out, "    %s\n", f)
				}
				continue
			}
			k := ckpts[i]
			fmt.Fprintf(out, "%v: ok: every loss, reduced gradient and parameter bit for bit the run's straight through "+
				"(rank 0: Save %.1f ms, %d bytes on disk; engine and GoMLX model rebuilt %.1f ms; Load %.1f ms)\n",
				spec, float64(k.save)/1e6, k.bytes, float64(k.rebuild)/1e6, float64(k.load)/1e6)
		}
	}

	fmt.Fprintf(out, "\ncost per step on rank 0 (median of steps 2..%d, the fastest of %d runs; ms; bytes); GoMLX alone: %.2f ms per step (one process, the whole batch, its AdamW)\n\n",
		c.steps, max(repeat, 1), median(ms(ref.wall[min(1, len(ref.wall)-1):])))
	fmt.Fprintf(out, "| run | wall | CPU, all ranks | GoMLX exec | GradsReady | gather wait | copy in | Step | GoMLX params | grads awaiting zero (peak: median, max) | stashed activations (peak) | copied into GoMLX | zero grad peak | zero param peak | zero's collectives | Go alloc, all ranks |\n")
	fmt.Fprintf(out, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|\n")
	for _, r := range runs {
		med := func(f func(stepCost) time.Duration) string {
			var xs []float64
			for _, s := range r.steps[min(1, len(r.steps)-1):] {
				xs = append(xs, float64(f(s))/1e6)
			}
			return fmt.Sprintf("%.2f", median(xs))
		}
		last := r.steps[len(r.steps)-1].stats
		var allocs []float64
		for _, a := range r.alloc[min(1, len(r.alloc)-1):] {
			allocs = append(allocs, float64(a))
		}
		coll := last.Collectives
		var pend []float64
		for _, s := range r.steps[min(1, len(r.steps)-1):] {
			pend = append(pend, float64(s.pending))
		}
		fmt.Fprintf(out, "| %v | %s | %s | %s | %s | %s | %s | %s | %d | %.0f, %d | %d | %d | %d | %d | %d RS + %d AR + %d AG | %.0f |\n", r.spec,
			med(func(s stepCost) time.Duration { return s.wall }),
			med(func(s stepCost) time.Duration { return s.cpu }),
			med(func(s stepCost) time.Duration { return s.exec }),
			med(func(s stepCost) time.Duration { return s.handOver }),
			med(func(s stepCost) time.Duration { return s.gatherWait }),
			med(func(s stepCost) time.Duration { return s.copyIn }),
			med(func(s stepCost) time.Duration { return s.step }),
			r.mem.gomlxParams, median(pend), r.mem.pendingPeak, r.mem.stashPeak, r.mem.copiedPerStp/int64(c.steps),
			last.PeakGradBytes, last.PeakParamBytes,
			coll[zero.KindReduceScatter].Calls, coll[zero.KindAllReduce].Calls, coll[zero.KindAllGather].Calls, median(allocs))
	}
	return ok, nil
}

func ms(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = float64(d) / 1e6
	}
	return out
}

// medianWall is a run's median step time, the first step left out.
func (r run) medianWall() float64 {
	var ws []time.Duration
	for _, s := range r.steps[min(1, len(r.steps)-1):] {
		ws = append(ws, s.wall)
	}
	return median(ms(ws))
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// cpuName names the processor (Linux), and the CPUs Go may use.
func cpuName() string {
	name := runtime.GOARCH
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				name = strings.TrimSpace(v)
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d CPUs", name, runtime.NumCPU())
}
