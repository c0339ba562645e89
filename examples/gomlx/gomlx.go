package main

// The model in GoMLX: context variables, and the graphs that run it, either
// whole (one forward and backward in one graph) or block by block.

import (
	"fmt"
	"time"

	"github.com/gomlx/gomlx/backends"
	"github.com/gomlx/gomlx/backends/simplego"
	"github.com/gomlx/gomlx/pkg/core/graph"
	"github.com/gomlx/gomlx/pkg/core/tensors"
	"github.com/gomlx/gomlx/pkg/ml/context"
	"github.com/gomlx/gomlx/pkg/ml/train/optimizers"
)

// newBackend is GoMLX's pure-Go backend: no C library, buffers in Go memory
// that Go code may read and write between executions ("shared buffers").
// Its operations run one after another within an execution: simplego
// v0.26.0 runs independent operations of one execution in parallel by
// default, and its executor then races on its own use counts (the race
// detector reports it in executeNode; a buffer may be reused in place
// while another operation still reads it). The ranks run in parallel
// anyway, one execution each.
func newBackend() (backends.Backend, error) { return simplego.New("ops_sequential") }

func blockScope(l int) string { return fmt.Sprintf("block%d", l) }

// newVariables creates, in ctx's scope, one block's variables holding vals
// (or zeros, where vals is nil), and gives them shared buffers at once: the
// memory GoMLX's graphs read them from, which Go (and zero) may write
// between executions. It returns the variables and their memory.
func newVariables(backend backends.Backend, ctx *context.Context, c config, vals [][]float32) ([4]*context.Variable, [4][]float32, error) {
	var vars [4]*context.Variable
	var mem [4][]float32
	for j, n := range c.sizes() {
		v := make([]float32, n)
		if vals != nil {
			copy(v, vals[j])
		}
		vars[j] = ctx.VariableWithValue(paramNames[j], tensors.FromFlatDataAndDimensions(v, c.dims(j)...))
		f, err := sharedMemory(backend, vars[j])
		if err != nil {
			return vars, mem, err
		}
		mem[j] = f
	}
	return vars, mem, nil
}

// sharedMemory returns the memory of a variable's value as a Go slice, with
// no copy: GoMLX moves the value into a shared buffer (simplego's are Go
// slices) and hands out that slice. The slice stays the variable's memory as
// long as GoMLX keeps the tensor: it does unless a graph changes the
// variable (Variable.SetValueGraph donates the buffer and the variable gets
// the output's) or Go calls Variable.SetValue; this program does neither.
func sharedMemory(backend backends.Backend, v *context.Variable) ([]float32, error) {
	t, err := v.Value()
	if err != nil {
		return nil, err
	}
	if err := t.MaterializeOnDevice(backend, true, 0); err != nil {
		return nil, err
	}
	if !t.IsShared() {
		return nil, fmt.Errorf("variable %s: the backend gave no shared buffer", v.ScopeAndName())
	}
	var flat []float32
	err = tensors.MutableFlatData(t, func(f []float32) { flat = f })
	return flat, err
}

// flatOf returns an execution's output's memory, with no copy: simplego's
// outputs are Go slices that BufferData hands out. The slice is valid until
// the tensor is finalized (its buffer then goes back to simplego's pool and
// the next execution may write it).
func flatOf(t *tensors.Tensor) ([]float32, error) {
	var flat []float32
	err := tensors.ConstFlatData(t, func(f []float32) { flat = f })
	return flat, err
}

// blockForward is one block on a batch of rows: a + tanh(a·W1 + b1)·W2 + b2,
// with the block's variables from ctx's scope.
func blockForward(ctx *context.Context, a *graph.Node) *graph.Node {
	g := a.Graph()
	v := func(name string) *graph.Node { return ctx.InspectVariableInScope(name).ValueGraph(g) }
	h := graph.Tanh(graph.Add(graph.Dot(a, v("w1")), graph.ExpandAxes(v("b1"), 0)))
	return graph.Add(a, graph.Add(graph.Dot(h, v("w2")), graph.ExpandAxes(v("b2"), 0)))
}

// blockParams returns the nodes of the block variables in ctx's scope.
func blockParams(ctx *context.Context, g *graph.Graph) []*graph.Node {
	out := make([]*graph.Node, 4)
	for j, name := range paramNames {
		out[j] = ctx.InspectVariableInScope(name).ValueGraph(g)
	}
	return out
}

// lossOf is ½·mean((a − y)²) over the batch and the width.
func lossOf(a, y *graph.Node) *graph.Node {
	r := graph.Sub(a, y)
	return graph.MulScalar(graph.ReduceAllMean(graph.Square(r)), 0.5)
}

// blockExecs are one block's graphs for the block-by-block run: forward
// (a → a'), backward (a, ∂L/∂a' → ∂L/∂a and the block's four gradients;
// it runs the block's forward again, since GoMLX differentiates within one
// graph only), and for the last block forward, loss and backward in one
// graph (a, y → loss, ∂L/∂a, gradients).
type blockExecs struct {
	forward, backward, last *context.Exec
}

func newBlockExecs(backend backends.Backend, ctx *context.Context) (blockExecs, error) {
	var b blockExecs
	var err error
	b.forward, err = context.NewExec(backend, ctx, func(ctx *context.Context, a *graph.Node) *graph.Node {
		return blockForward(ctx, a)
	})
	if err != nil {
		return b, err
	}
	b.backward, err = context.NewExec(backend, ctx, func(ctx *context.Context, a, dy *graph.Node) []*graph.Node {
		y := blockForward(ctx, a)
		wrt := append([]*graph.Node{a}, blockParams(ctx, a.Graph())...)
		return graph.Gradient(graph.ReduceAllSum(graph.Mul(y, dy)), wrt...)
	})
	if err != nil {
		return b, err
	}
	b.last, err = context.NewExec(backend, ctx, func(ctx *context.Context, a, y *graph.Node) []*graph.Node {
		loss := lossOf(blockForward(ctx, a), y)
		wrt := append([]*graph.Node{a}, blockParams(ctx, a.Graph())...)
		return append([]*graph.Node{loss}, graph.Gradient(loss, wrt...)...)
	})
	return b, err
}

// modelLoss is the whole model's loss, the blocks' variables in scopes
// block0, block1, … of ctx.
func modelLoss(ctx *context.Context, c config, x, y *graph.Node) *graph.Node {
	a := x
	for l := range c.blocks {
		a = blockForward(ctx.In(blockScope(l)), a)
	}
	return lossOf(a, y)
}

// newWholeExec is the single-graph version: x, y → loss and every
// parameter's gradient, in registration order, from one execution.
func newWholeExec(backend backends.Backend, ctx *context.Context, c config) (*context.Exec, error) {
	return context.NewExec(backend, ctx, func(ctx *context.Context, x, y *graph.Node) []*graph.Node {
		loss := modelLoss(ctx, c, x, y)
		var wrt []*graph.Node
		for l := range c.blocks {
			wrt = append(wrt, blockParams(ctx.In(blockScope(l)), x.Graph())...)
		}
		return append([]*graph.Node{loss}, graph.Gradient(loss, wrt...)...)
	})
}

// ---- the reference: one process, the whole batch, GoMLX's own AdamW --------

// reference is GoMLX training the model alone: the whole batch in one
// graph, and GoMLX's AdamW (optimizers.Adam with weight decay) updating its
// variables. It returns the parameters before the first step and after
// each, and each step's loss (at the parameters before it).
type reference struct {
	params [][][]float32
	loss   []float64
	wall   []time.Duration // per step
}

func runReference(c config) (reference, error) {
	var ref reference
	backend, err := newBackend()
	if err != nil {
		return ref, err
	}
	defer backend.Finalize()
	ctx := context.New()
	init := c.initial()
	vars := make([]*context.Variable, 0, c.numParams())
	for l := range c.blocks {
		vs, _, err := newVariables(backend, ctx.In(blockScope(l)), c, init[4*l:4*l+4])
		if err != nil {
			return ref, err
		}
		vars = append(vars, vs[:]...)
	}
	// GoMLX's Adam with decoupled weight decay: its epsilon defaults to
	// 1e-7 (zero's to 1e-8), so both take c.eps.
	opt := optimizers.Adam().LearningRate(c.lr).Epsilon(c.eps).WeightDecay(c.wd).Done()
	step, err := context.NewExec(backend, ctx, func(ctx *context.Context, x, y *graph.Node) *graph.Node {
		loss := modelLoss(ctx, c, x, y)
		opt.UpdateGraph(ctx, x.Graph(), loss)
		return loss
	})
	if err != nil {
		return ref, err
	}
	defer step.Finalize()
	read := func() error {
		snap := make([][]float32, len(vars))
		for p, v := range vars {
			t, err := v.Value()
			if err != nil {
				return err
			}
			if snap[p], err = tensors.CopyFlatData[float32](t); err != nil {
				return err
			}
		}
		ref.params = append(ref.params, snap)
		return nil
	}
	if err := read(); err != nil {
		return ref, err
	}
	for st := range c.steps {
		x, y := c.batchData(st)
		t0 := time.Now()
		loss, err := step.Exec1(tensors.FromFlatDataAndDimensions(x, c.batch, c.width),
			tensors.FromFlatDataAndDimensions(y, c.batch, c.width))
		if err != nil {
			return ref, err
		}
		l, err := tensors.CopyFlatData[float32](loss)
		if err != nil {
			return ref, err
		}
		loss.MustFinalizeAll()
		ref.wall = append(ref.wall, time.Since(t0))
		ref.loss = append(ref.loss, float64(l[0]))
		if err := read(); err != nil {
			return ref, err
		}
	}
	return ref, nil
}

// ---- GoMLX at any parameters, for the check -----------------------------------

// evaluator runs GoMLX's whole-batch graph (loss and every gradient) at
// parameters it is given: the gradient GoMLX's own AdamW steps with, at the
// reference's parameters and at zero's.
type evaluator struct {
	c       config
	backend backends.Backend
	ctx     *context.Context
	mem     [][]float32 // the variables' shared memory, written before each run
	whole   *context.Exec
}

func newEvaluator(c config) (*evaluator, error) {
	backend, err := newBackend()
	if err != nil {
		return nil, err
	}
	ev := &evaluator{c: c, backend: backend, ctx: context.New()}
	init := c.initial()
	for l := range c.blocks {
		_, m, err := newVariables(backend, ev.ctx.In(blockScope(l)), c, init[4*l:4*l+4])
		if err != nil {
			return nil, err
		}
		ev.mem = append(ev.mem, m[:]...)
	}
	if ev.whole, err = newWholeExec(backend, ev.ctx, c); err != nil {
		return nil, err
	}
	return ev, nil
}

func (ev *evaluator) close() { ev.backend.Finalize() }

// at returns GoMLX's loss and gradients on step st's whole batch at params.
func (ev *evaluator) at(params [][]float32, st int) (float64, [][]float32, error) {
	for p := range ev.mem {
		copy(ev.mem[p], params[p])
	}
	x, y := ev.c.batchData(st)
	out, err := ev.whole.Exec(tensors.FromFlatDataAndDimensions(x, ev.c.batch, ev.c.width),
		tensors.FromFlatDataAndDimensions(y, ev.c.batch, ev.c.width))
	if err != nil {
		return 0, nil, err
	}
	loss, err := tensors.CopyFlatData[float32](out[0])
	if err != nil {
		return 0, nil, err
	}
	grads := make([][]float32, len(out)-1)
	for p, t := range out[1:] {
		if grads[p], err = tensors.CopyFlatData[float32](t); err != nil {
			return 0, nil, err
		}
	}
	for _, t := range out {
		t.MustFinalizeAll()
	}
	return float64(loss[0]), grads, nil
}

// rowsIdentical checks what the tight bounds rest on: GoMLX computes each
// row of a batch (a sample's activations, its gradient by the block's
// input) with the same operations in the same order whatever the batch, so
// zero's micro-batches and the reference's whole batch differ only in how
// the batch sums (the weights' and biases' gradients, the loss) are
// grouped. It runs a block's three graphs on the whole batch and on its
// first micro-batch and compares the rows bit for bit.
func (ev *evaluator) rowsIdentical() error {
	c := ev.c
	b, err := newBlockExecs(ev.backend, ev.ctx.In(blockScope(0)))
	if err != nil {
		return err
	}
	defer func() {
		b.forward.Finalize()
		b.backward.Finalize()
		b.last.Finalize()
	}()
	x, y := c.batchData(0)
	// rows returns graph which's rows on the first n samples: the forward's
	// output, or the backward's or the last block's gradient by the input
	rows := func(which, n int) ([]float32, error) {
		xt := tensors.FromFlatDataAndDimensions(x[:n*c.width], n, c.width)
		yt := tensors.FromFlatDataAndDimensions(y[:n*c.width], n, c.width)
		var ts []*tensors.Tensor
		var err error
		out := 0
		switch which {
		case 0:
			ts, err = b.forward.Exec(xt)
		case 1:
			ts, err = b.backward.Exec(xt, yt) // y stands in for ∂L/∂a'
		default:
			ts, err = b.last.Exec(xt, yt)
			out = 1
		}
		if err != nil {
			return nil, err
		}
		return tensors.CopyFlatData[float32](ts[out])
	}
	for which, name := range []string{"forward", "backward (gradient by the input)", "last block (gradient by the input)"} {
		whole, err := rows(which, c.batch)
		if err != nil {
			return err
		}
		part, err := rows(which, c.micro())
		if err != nil {
			return err
		}
		// the last block's loss is a mean over its rows: on the whole batch
		// its gradient carries 1/B where the micro-batch's carries 1/m, a
		// power of two apart (exact)
		scale := float32(1)
		if which == 2 {
			scale = float32(c.batch / c.micro())
		}
		for i := range part {
			if part[i] != whole[i]*scale {
				return fmt.Errorf("GoMLX's %s computes row %d differently on %d rows than on %d: the bounds assume one arithmetic per row",
					name, i/c.width, c.micro(), c.batch)
			}
		}
	}
	return nil
}
