package main

// Training with zero: W in-process ranks, each with its own GoMLX backend
// and its shard of every batch, GoMLX computing the gradients and zero
// reducing them and running AdamW.

import (
	"encoding/binary"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"syscall"
	"time"

	"github.com/gomlx/gomlx/backends"
	"github.com/gomlx/gomlx/pkg/core/tensors"
	"github.com/gomlx/gomlx/pkg/ml/context"

	"zero"
)

// runSpec is one way of training with zero.
type runSpec struct {
	stage int
	whole bool // one graph for the whole model (gradients come at its end)
	// resumeAt > 0: after that many steps every rank saves a checkpoint
	// (Engine.Save), closes its engine and its GoMLX backend, builds both
	// afresh from the initial values and loads the checkpoint (Engine.Load,
	// with load's options) before going on.
	resumeAt int
	load     zero.LoadOptions
}

func (s runSpec) String() string {
	way := "block by block"
	if s.whole {
		way = "single graph"
	}
	if s.resumeAt > 0 {
		way += fmt.Sprintf(", saved and resumed after step %d", s.resumeAt)
	}
	return fmt.Sprintf("ZeRO-%d %s", s.stage, way)
}

// run is what a zero run records on rank 0.
type run struct {
	spec   runSpec
	params [][][]float32 // before the first step and after each
	grads  [][][]float32 // the reduced mean gradient each step used
	loss   []float64     // each step's global loss, at the parameters before it
	steps  []stepCost
	mem    memCost
	alloc  []uint64 // Go bytes allocated per step, every rank together
	ckpt   ckptCost // a resumed run's
}

// ckptCost is what a resume took on rank 0.
type ckptCost struct {
	save, rebuild, load time.Duration // Save; closing and building the rank afresh; Load
	bytes               int64         // the checkpoint on disk, every rank's files and the manifest
}

// stepCost is where one step's time on rank 0 went.
type stepCost struct {
	wall       time.Duration // from the first forward to Step's return
	cpu        time.Duration // the process's CPU time over the same span: every rank, GoMLX and zero
	exec       time.Duration // GoMLX executions
	handOver   time.Duration // GradReady calls
	gatherWait time.Duration // stage 3: waiting for gathers before a copy
	copyIn     time.Duration // stage 3: copying gathered views into GoMLX memory
	step       time.Duration // Engine.Step
	pending    int64         // peak bytes of GoMLX gradients waiting for GradReady's event
	stats      zero.Stats
}

// memCost is rank 0's memory over the run, in bytes.
type memCost struct {
	gomlxParams  int64 // parameter memory GoMLX holds
	pendingPeak  int64 // GoMLX gradient buffers waiting for GradReady's event
	stashPeak    int64 // block by block: activations kept for the backward
	copiedPerStp int64 // stage 3: bytes copied from gathered views into GoMLX per step
}

// f32 rounds a hyperparameter as GoMLX holds it: its Adam keeps the
// learning rate, the betas, epsilon and the decay in the loss's dtype.
func f32(x float64) float64 { return float64(float32(x)) }

// zeroAdamW is zero's AdamW with GoMLX's settings, rounded as GoMLX holds
// them, so both run the same arithmetic to the rounding of its operations.
func zeroAdamW(c config) zero.AdamW {
	o := zero.NewAdamW(f32(c.lr))
	o.Beta1, o.Beta2 = f32(0.9), f32(0.999) // GoMLX's defaults, as fp32 constants
	o.Eps = f32(c.eps)
	o.WeightDecay = f32(c.wd) // GoMLX decays every variable: one group
	return o
}

// trainZero trains c.steps steps on c.world ranks with spec.
func trainZero(c config, spec runSpec) (run, error) {
	res := run{spec: spec}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	last := ms.TotalAlloc
	var dir string
	if spec.resumeAt > 0 {
		var err error
		if dir, err = os.MkdirTemp("", "zero-gomlx-checkpoint-"); err != nil {
			return res, err
		}
		defer os.RemoveAll(dir)
	}
	err := zero.RunLocal(c.world, func(comm zero.Comm) error {
		r, err := newRank(c, spec, comm, false)
		if err != nil {
			return err
		}
		defer func() { r.close() }() // the rank a resume built, if it did
		if comm.Rank() == 0 {
			r.rec = &res
			res.mem.gomlxParams = r.heldParams
		}
		if err := r.record(); err != nil {
			return err
		}
		for st := range c.steps {
			if st > 0 && st == spec.resumeAt {
				if r, err = r.resume(dir, st); err != nil {
					return fmt.Errorf("rank %d, resuming after step %d: %w", comm.Rank(), st, err)
				}
			}
			if err := r.step(st); err != nil {
				return fmt.Errorf("rank %d, step %d: %w", comm.Rank(), st+1, err)
			}
			if comm.Rank() == 0 {
				runtime.ReadMemStats(&ms)
				res.alloc = append(res.alloc, ms.TotalAlloc-last)
				last = ms.TotalAlloc
			}
		}
		return nil
	})
	return res, err
}

// rank is one rank's GoMLX model and zero engine.
type rank struct {
	c       config
	spec    runSpec
	comm    zero.Comm
	backend backends.Backend
	e       *zero.Engine
	grads   *zero.HostStream // the stream GoMLX's gradients are handed over on
	gathers *zero.HostStream // stage 3: the stream the gathers complete on

	mem    [][]float32  // per parameter, GoMLX's memory of it (nil at stage 3 block by block)
	blocks []blockExecs // per block; at stage 3 block by block, one set on the slot
	slot   [4][]float32 // stage 3 block by block: the one block GoMLX holds
	whole  *context.Exec

	pending      []pendingGrads
	pendingBytes int64
	heldParams   int64 // parameter bytes GoMLX holds
	cost         stepCost
	rec          *run
	closed       bool
}

// pendingGrads is GoMLX gradient memory zero still reads: its buffers may
// go back to simplego's pool (where the next execution takes them) only
// once ev fires.
type pendingGrads struct {
	ev    zero.Event
	ts    []*tensors.Tensor
	bytes int64
}

func ids(l int) []int { return []int{4 * l, 4*l + 1, 4*l + 2, 4*l + 3} }

// newRank builds a rank's GoMLX model and engine, the parameters at their
// initial values. toLoad: a checkpoint will fill them (no broadcast).
func newRank(c config, spec runSpec, comm zero.Comm, toLoad bool) (*rank, error) {
	r := &rank{c: c, spec: spec, comm: comm, mem: make([][]float32, c.numParams())}
	var err error
	if r.backend, err = newBackend(); err != nil {
		return nil, err
	}
	ctx := context.New()
	init := c.initial()
	sharded := spec.stage == 3 && !spec.whole
	var held int64
	if !sharded {
		// GoMLX holds the whole model. At stages 1 and 2 zero writes each
		// step's new values straight into these variables' memory; at stage
		// 3 (single graph) they are where the gathered parameters are
		// copied before the graph runs.
		for l := range c.blocks {
			_, m, err := newVariables(r.backend, ctx.In(blockScope(l)), c, init[4*l:4*l+4])
			if err != nil {
				return nil, err
			}
			for j := range m {
				r.mem[4*l+j] = m[j]
				held += int64(4 * len(m[j]))
			}
		}
	} else {
		// GoMLX holds one block, the slot, which every block's gathered
		// parameters are copied into before its forward and its backward.
		var err error
		if _, r.slot, err = newVariables(r.backend, ctx.In("slot"), c, nil); err != nil {
			return nil, err
		}
		held = int64(4 * c.blockElems())
		b, err := newBlockExecs(r.backend, ctx.In("slot"))
		if err != nil {
			return nil, err
		}
		r.blocks = []blockExecs{b}
	}
	switch {
	case spec.whole:
		r.whole, err = newWholeExec(r.backend, ctx, c)
	case !sharded:
		for l := range c.blocks {
			b, err := newBlockExecs(r.backend, ctx.In(blockScope(l)))
			if err != nil {
				return nil, err
			}
			r.blocks = append(r.blocks, b)
		}
	}
	if err != nil {
		return nil, err
	}
	params := make([]zero.Param, c.numParams())
	for l := range c.blocks {
		for j, n := range c.sizes() {
			p := zero.Param{Name: blockScope(l) + "." + paramNames[j], Count: n, Shape: c.dims(j), DType: zero.FP32}
			if spec.stage < 3 {
				p.Data = zero.Float32s(r.mem[4*l+j]) // the variable's own memory: Step writes it
			} else {
				// built sharded: each rank fills its own range, by position
				p.Init = func(dst []float32, offset int) error {
					for i := range dst {
						dst[i] = c.initValue(l, j, offset+i)
					}
					return nil
				}
			}
			params[4*l+j] = p
		}
	}
	// One bucket per block (the block's bytes, a multiple of 16): a block's
	// gradients fill exactly one bucket, and at stage 3 its gather is one
	// all-gather.
	r.e, err = zero.New(zero.Config{Stage: spec.stage, BucketBytes: 4 * c.blockElems(), Overlap: true,
		Params:    zero.ParamPolicy{NoBroadcast: toLoad},
		Optimizer: zero.OptimizerPolicy{Groups: []zero.Optimizer{zeroAdamW(c)}}}, comm, params)
	if err != nil {
		return nil, err
	}
	r.grads, r.gathers = zero.NewHostStream(), zero.NewHostStream()
	r.heldParams = held
	return r, nil
}

// resume saves a checkpoint after step st (the steps taken), with the next
// step's index as this rank's own bytes, closes the rank (engine, GoMLX
// backend, variables), builds a new one at the initial values and loads the
// checkpoint into it: at stages 1 and 2 Load writes the parameters into the
// new GoMLX variables' memory, as Step does.
func (r *rank) resume(dir string, st int) (*rank, error) {
	t0 := time.Now()
	if err := r.e.Save(dir, zero.SaveOptions{Client: binary.LittleEndian.AppendUint64(nil, uint64(st))}); err != nil {
		return r, err
	}
	t1 := time.Now()
	rec := r.rec
	r.close()
	nr, err := newRank(r.c, r.spec, r.comm, true)
	if err != nil {
		return r, err // closed: closing again does nothing
	}
	t2 := time.Now()
	loaded, err := nr.e.Load(dir, r.spec.load)
	if client := loaded.Client; err == nil && (len(client) != 8 || binary.LittleEndian.Uint64(client) != uint64(st)) {
		err = fmt.Errorf("Load returned %d bytes of this rank's own state (%x), saved: the next step, %d", len(client), client, st)
	}
	nr.rec = rec
	if rec != nil {
		rec.ckpt = ckptCost{save: t1.Sub(t0), rebuild: t2.Sub(t1), load: time.Since(t2), bytes: diskBytes(dir)}
	}
	return nr, err
}

// diskBytes is the size of the regular files under dir.
func diskBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// close gives back the rank's engine and GoMLX backend; twice does nothing.
func (r *rank) close() {
	if r.closed {
		return
	}
	r.closed = true
	r.reap(true)
	if r.e != nil {
		r.e.Close()
	}
	if r.grads != nil {
		r.grads.Close()
		r.gathers.Close()
	}
	r.backend.Finalize()
}

// fill makes parameters ps (stage 3) available to GoMLX: all-gathered by
// zero, then copied into GoMLX's memory (the slot, or the whole model's
// variables), since a GoMLX graph reads its parameters from buffers of its
// own; the views are released once copied. Below stage 3, GoMLX's
// variables already hold the values Step wrote.
func (r *rank) fill(ps []int) error {
	if r.spec.stage < 3 {
		return nil
	}
	views, err := r.e.Gather(r.gathers, ps...)
	if err != nil {
		return err
	}
	t0 := time.Now()
	// GoMLX runs its graphs on this goroutine, with no stream to order them
	// after the gather: wait for it here.
	if err := r.gathers.Sync(); err != nil {
		return err
	}
	t1 := time.Now()
	for i, p := range ps {
		dst := r.mem[p]
		if dst == nil {
			dst = r.slot[p%4]
		}
		copy(dst, views[i].HostFloat32s())
		if r.rec != nil {
			r.rec.mem.copiedPerStp += int64(4 * len(dst))
		}
	}
	r.cost.gatherWait += t1.Sub(t0)
	r.cost.copyIn += time.Since(t1)
	return r.e.Release(r.gathers, ps...)
}

// hand gives zero the gradients of parameters ps, which GoMLX's last
// execution returned in ts: the outputs' own memory, no copy. GoMLX wrote
// them on this goroutine before the call returned, so the host stream that
// reads them needs no event to wait for. The buffers stay GoMLX's but must
// not be reused until the returned event fires: they go on the pending list.
func (r *rank) hand(ps []int, ts []*tensors.Tensor) error {
	t0 := time.Now()
	gs := make([]zero.Tensor, len(ts))
	var bytes int64
	for i, t := range ts {
		f, err := flatOf(t)
		if err != nil {
			return err
		}
		gs[i] = zero.Float32s(f)
		bytes += int64(4 * len(f))
	}
	ev, err := r.e.GradsReady(ps, gs, r.grads)
	if err != nil {
		return err
	}
	r.cost.handOver += time.Since(t0)
	r.pending = append(r.pending, pendingGrads{ev: ev, ts: ts, bytes: bytes})
	r.pendingBytes += bytes
	r.cost.pending = max(r.cost.pending, r.pendingBytes)
	if r.rec != nil {
		r.rec.mem.pendingPeak = max(r.rec.mem.pendingPeak, r.pendingBytes)
	}
	r.reap(false)
	return nil
}

// reap gives simplego back the gradient buffers zero is done with (all of
// them, waiting, when wait is set).
func (r *rank) reap(wait bool) {
	keep := r.pending[:0]
	for _, pg := range r.pending {
		if wait && pg.ev != nil {
			_ = pg.ev.Sync() // an error here is the engine's, and Step reports it
		} else if pg.ev != nil && !pg.ev.Done() {
			keep = append(keep, pg)
			continue
		}
		for _, t := range pg.ts {
			t.MustFinalizeAll()
		}
		r.pendingBytes -= pg.bytes
	}
	clear(r.pending[len(keep):])
	r.pending = keep
}

// execs returns block l's graphs.
func (r *rank) execs(l int) blockExecs {
	if len(r.blocks) == 1 {
		return r.blocks[0]
	}
	return r.blocks[l]
}

// timed runs a GoMLX execution and counts its time.
func (r *rank) timed(e *context.Exec, args ...any) ([]*tensors.Tensor, error) {
	t0 := time.Now()
	out, err := e.Exec(args...)
	r.cost.exec += time.Since(t0)
	return out, err
}

func scalarOf(t *tensors.Tensor) (float64, error) {
	f, err := flatOf(t)
	if err != nil {
		return 0, err
	}
	v := float64(f[0])
	return v, t.FinalizeAll()
}

// blocksBackward is one forward and backward, block by block: each block's
// gradients go to zero as soon as its backward graph returns, and are
// reduced (here: summed into the window) while the next block's runs; at
// stage 3 each block is gathered just before its forward and again before
// its backward.
func (r *rank) blocksBackward(x, y *tensors.Tensor) (float64, error) {
	L := r.c.blocks
	acts := make([]*tensors.Tensor, L) // each block's input, kept for its backward
	acts[0] = x
	var stash int64
	defer func() {
		for _, a := range acts[1:] {
			if a != nil {
				a.FinalizeAll()
			}
		}
	}()
	for l := range L - 1 {
		if err := r.fill(ids(l)); err != nil {
			return 0, err
		}
		out, err := r.timed(r.execs(l).forward, acts[l])
		if err != nil {
			return 0, err
		}
		acts[l+1] = out[0]
		stash += int64(out[0].Memory())
	}
	if r.rec != nil {
		r.rec.mem.stashPeak = max(r.rec.mem.stashPeak, stash)
	}
	if err := r.fill(ids(L - 1)); err != nil {
		return 0, err
	}
	out, err := r.timed(r.execs(L-1).last, acts[L-1], y)
	if err != nil {
		return 0, err
	}
	loss, err := scalarOf(out[0])
	if err != nil {
		return 0, err
	}
	if err := r.hand(ids(L-1), out[2:6]); err != nil {
		return 0, err
	}
	dy := out[1]
	for l := L - 2; l >= 0; l-- {
		if err := r.fill(ids(l)); err != nil {
			return 0, err
		}
		out, err := r.timed(r.execs(l).backward, acts[l], dy)
		dy.FinalizeAll()
		if err != nil {
			return 0, err
		}
		if err := r.hand(ids(l), out[1:5]); err != nil {
			return 0, err
		}
		if l > 0 {
			acts[l].FinalizeAll()
			acts[l] = nil
		}
		dy = out[0]
	}
	dy.FinalizeAll() // the gradient by the input: not needed
	return loss, nil
}

// wholeBackward is one forward and backward in one graph: every gradient
// arrives when the execution ends, and at stage 3 the whole model is
// gathered first.
func (r *rank) wholeBackward(x, y *tensors.Tensor) (float64, error) {
	all := make([]int, r.c.numParams())
	for p := range all {
		all[p] = p
	}
	if err := r.fill(all); err != nil {
		return 0, err
	}
	out, err := r.timed(r.whole, x, y)
	if err != nil {
		return 0, err
	}
	loss, err := scalarOf(out[0])
	if err != nil {
		return 0, err
	}
	return loss, r.hand(all, out[1:])
}

// step is one optimizer step: G backwards in a coalesced window, Step, the
// loss averaged over the ranks, and on rank 0 the record.
func (r *rank) step(st int) error {
	c := r.c
	x, y := c.batchData(st)
	r.cost = stepCost{}
	t0, cpu0 := time.Now(), cpuTime()
	loss := 0.0
	err := r.e.Coalesce(func() error {
		for k := range c.accum {
			from, to := c.microRange(r.comm.Rank(), k)
			xt := tensors.FromFlatDataAndDimensions(c.rows(x, from, to), c.micro(), c.width)
			yt := tensors.FromFlatDataAndDimensions(c.rows(y, from, to), c.micro(), c.width)
			var l float64
			var err error
			if r.spec.whole {
				l, err = r.wholeBackward(xt, yt)
			} else {
				l, err = r.blocksBackward(xt, yt)
			}
			xt.FinalizeAll()
			yt.FinalizeAll()
			if err != nil {
				return err
			}
			loss += l / float64(c.accum)
			if err := r.e.EndBackward(); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	r.reap(true) // the events are the engine's until Step
	ts := time.Now()
	if err := r.e.Step(); err != nil {
		return err
	}
	r.cost.step = time.Since(ts)
	r.cost.wall, r.cost.cpu = time.Since(t0), cpuTime()-cpu0
	r.cost.stats = r.e.Stats()
	if r.cost.stats.Skipped {
		return fmt.Errorf("step skipped: gradient norm %g", r.cost.stats.GradNorm)
	}
	// the global batch's loss: the mean of the ranks' means
	global, err := zero.AllReduceScalars(r.comm, zero.OpAvg, loss)
	if err != nil {
		return err
	}
	grads, err := r.e.FullGrads() // a collective: every rank
	if err != nil {
		return err
	}
	if r.rec != nil {
		r.rec.loss = append(r.rec.loss, global[0])
		r.rec.grads = append(r.rec.grads, grads)
		r.rec.steps = append(r.rec.steps, r.cost)
	}
	return r.record()
}

// record notes the current parameters on rank 0: at stages 1 and 2 read
// from GoMLX's own variables, where Step wrote them; at stage 3 from
// zero's shards (FullParams, a collective), since GoMLX holds at most the
// slot (the copies into it are checked through the gradients, which GoMLX
// computes from them).
func (r *rank) record() error {
	var ps [][]float32
	if r.spec.stage == 3 {
		var err error
		if ps, err = r.e.FullParams(); err != nil {
			return err
		}
	} else if r.rec != nil {
		for _, m := range r.mem {
			ps = append(ps, slices.Clone(m))
		}
	}
	if r.rec != nil {
		for _, p := range ps {
			for _, v := range p {
				if math.IsNaN(float64(v)) {
					return fmt.Errorf("a parameter is NaN")
				}
			}
		}
		r.rec.params = append(r.rec.params, ps)
	}
	return nil
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
