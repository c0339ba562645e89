package main

import (
	"fmt"
	"math"
)

// config is one training setup, shared by the reference and every zero run.
type config struct {
	world  int // W in-process ranks
	accum  int // G backwards per step and rank (one coalesced window)
	steps  int
	batch  int // B samples per step, over every rank
	width  int // D: the residual stream
	hidden int // H: each block's hidden layer
	blocks int // L residual blocks
	lr, wd float64
	eps    float64 // AdamW's epsilon, the same in GoMLX and zero
	seed   uint64
}

func defaultConfig() config {
	return config{world: 2, accum: 2, steps: 10, batch: 64, width: 32, hidden: 64, blocks: 4,
		lr: 0.01, wd: 0.01, eps: 1e-7, seed: 1}
}

// micro is the samples of one backward on one rank.
func (c config) micro() int { return c.batch / (c.world * c.accum) }

func (c config) check() error {
	pow2 := func(n int) bool { return n > 0 && n&(n-1) == 0 }
	switch {
	case c.world < 1 || c.accum < 1 || c.steps < 1 || c.blocks < 1 || c.width < 1 || c.hidden < 1:
		return fmt.Errorf("world, accum, steps, blocks, width and hidden must be at least 1")
	case c.batch%(c.world*c.accum) != 0:
		return fmt.Errorf("batch %d does not split into %d ranks × %d backwards", c.batch, c.world, c.accum)
	case !pow2(c.batch) || !pow2(c.world*c.accum) || !pow2(c.width):
		// The means then scale by powers of two, exactly, in every run;
		// the error bound counts no rounding for them.
		return fmt.Errorf("batch, world×accum and width must be powers of two (the bound counts the means' scalings as exact)")
	}
	return nil
}

// The model: L residual blocks a ← a + tanh(a·W1 + b1)·W2 + b2 on a stream
// of width D, and the loss ½·mean((a_L − y)²) over the batch and the width.
// Each block has four parameters, registered block by block in this order.
var paramNames = [4]string{"w1", "b1", "w2", "b2"}

// sizes of one block's parameters: W1 [D,H], b1 [H], W2 [H,D], b2 [D].
func (c config) sizes() [4]int {
	return [4]int{c.width * c.hidden, c.hidden, c.hidden * c.width, c.width}
}

// dims of parameter j of a block, as GoMLX sees it.
func (c config) dims(j int) []int {
	switch j {
	case 0:
		return []int{c.width, c.hidden}
	case 1:
		return []int{c.hidden}
	case 2:
		return []int{c.hidden, c.width}
	}
	return []int{c.width}
}

// blockElems is the number of parameters of one block.
func (c config) blockElems() int {
	s := c.sizes()
	return s[0] + s[1] + s[2] + s[3]
}

// numParams is the number of parameter tensors: four per block.
func (c config) numParams() int { return 4 * c.blocks }

// ---- values by position ------------------------------------------------------

// mix is SplitMix64: a value from a position, so every rank, the
// reference and Param.Init (which fills any range of a parameter) draw
// the same numbers without a shared generator.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// uniform returns a number in [-1, 1) for the position (a, b, c, d).
func uniform(a, b, c, d uint64) float64 {
	h := mix(mix(mix(mix(a)^b)^c) ^ d)
	return float64(h>>11)/(1<<52) - 1
}

// initValue is element i of parameter j of block l: W1 ~ U(±1/√D),
// W2 ~ U(±0.5/√H), biases ~ U(±0.1).
func (c config) initValue(l, j, i int) float32 {
	scale := 0.1
	switch j {
	case 0:
		scale = 1 / math.Sqrt(float64(c.width))
	case 2:
		scale = 0.5 / math.Sqrt(float64(c.hidden))
	}
	return float32(scale * uniform(c.seed, 1, uint64(4*l+j), uint64(i)))
}

// initial returns every parameter's starting values, in registration order.
func (c config) initial() [][]float32 {
	out := make([][]float32, c.numParams())
	for l := range c.blocks {
		for j, n := range c.sizes() {
			p := make([]float32, n)
			for i := range p {
				p[i] = c.initValue(l, j, i)
			}
			out[4*l+j] = p
		}
	}
	return out
}

// batchData is step st's global batch: inputs x ∈ U(−1, 1)^D and targets
// y_d = sin(Σ_k A_dk x_k) (A fixed, ~U(±2/√D)), rows of D values.
func (c config) batchData(st int) (x, y []float32) {
	D := c.width
	x, y = make([]float32, c.batch*D), make([]float32, c.batch*D)
	for s := range c.batch {
		for k := range D {
			x[s*D+k] = float32(uniform(c.seed, 2, uint64(st*c.batch+s), uint64(k)))
		}
		for d := range D {
			z := 0.0
			for k := range D {
				z += 2 / math.Sqrt(float64(D)) * uniform(c.seed, 3, uint64(d), uint64(k)) * float64(x[s*D+k])
			}
			y[s*D+d] = float32(math.Sin(z))
		}
	}
	return x, y
}

// rows returns samples [from, to) of a batch's rows of D values.
func (c config) rows(v []float32, from, to int) []float32 { return v[from*c.width : to*c.width] }

// microRange is the samples rank r takes in its k-th backward.
func (c config) microRange(r, k int) (from, to int) {
	from = (r*c.accum + k) * c.micro()
	return from, from + c.micro()
}

// ---- the float64 oracle -------------------------------------------------------

// u is fp32's unit roundoff.
const u = 0x1p-24

func gamma(n int) float64 { return float64(n) * u / (1 - float64(n)*u) }

// oracle is the loss and gradient of the whole batch at given fp32
// parameters, in float64, with a first-order bound on how far any fp32
// evaluation of the same graph (GoMLX's whole-batch graph, or the block
// graphs on micro-batches whose gradients zero sums and averages) can lie
// from them.
//
// The bound is a running error analysis: every value v carries e(v), a
// bound on |fl(v) − v|. A dot product of n terms adds γ_n·Σ|terms| whatever
// its order of summation (so GoMLX's DotGeneral may block and parallelise
// as it likes); tanh, computed in float64 and rounded, adds u·|h|; an
// element-wise product or sum adds u·|result|; errors carried in propagate
// through |W|, |tanh'| and the like. Per sample, the gradient terms get
// their own bound; the batch sum then adds γ_nb·Σ_s|term| with nb = B +
// W·G + 4, more additions than either the reference (B, inside one graph)
// or zero (B/(W·G) in a graph, then W·G partial sums) makes. The means'
// scalings are powers of two, exact (config.check).
type oracle struct {
	loss, lossErr float64
	grad, err     [][]float64 // per parameter: the gradient and its bound
	// abs is Σ_s |sample s's term| / N, and rowErr the part of err that
	// bounds the per-sample terms' own errors, Σ_s e(term_s) / N: so
	// Σ_s |fl(term_s)| / N ≤ abs + rowErr.
	abs, rowErr [][]float64
}

// evaluate runs the oracle at params (registration order) on step st's batch.
func (c config) evaluate(params [][]float32, x32, y32 []float32) oracle {
	D, H, L, B := c.width, c.hidden, c.blocks, c.batch
	nb := B + c.world*c.accum + 4
	o := oracle{grad: make([][]float64, c.numParams()), err: make([][]float64, c.numParams())}
	o.abs, o.rowErr = make([][]float64, c.numParams()), make([][]float64, c.numParams())
	abs := o.abs
	for p := range o.grad {
		n := len(params[p])
		o.grad[p], o.err[p], abs[p], o.rowErr[p] = make([]float64, n), make([]float64, n), make([]float64, n), make([]float64, n)
	}
	w := make([][]float64, len(params))
	for p := range params {
		w[p] = make([]float64, len(params[p]))
		for i, v := range params[p] {
			w[p][i] = float64(v)
		}
	}
	// per sample: activations a_l (and bounds), hidden h_l (and bounds)
	a, ea := make([][]float64, L+1), make([][]float64, L+1)
	h, eh := make([][]float64, L), make([][]float64, L)
	for l := range L + 1 {
		a[l], ea[l] = make([]float64, D), make([]float64, D)
		if l < L {
			h[l], eh[l] = make([]float64, H), make([]float64, H)
		}
	}
	delta, edelta := make([]float64, D), make([]float64, D)
	dz, edz := make([]float64, H), make([]float64, H)
	sumAbsR2, sumRErr := 0.0, 0.0
	N := float64(B * D)
	for s := range B {
		for k := range D {
			a[0][k], ea[0][k] = float64(x32[s*D+k]), 0
		}
		for l := range L {
			w1, b1, w2, b2 := w[4*l], w[4*l+1], w[4*l+2], w[4*l+3]
			for j := range H {
				z, az, ez := b1[j], math.Abs(b1[j]), 0.0
				for k := range D {
					z += a[l][k] * w1[k*H+j]
					az += math.Abs(a[l][k] * w1[k*H+j])
					ez += math.Abs(w1[k*H+j]) * ea[l][k]
				}
				ez += gamma(D+1) * az
				h[l][j] = math.Tanh(z)
				eh[l][j] = (1-h[l][j]*h[l][j])*ez + u*math.Abs(h[l][j])
			}
			for d := range D {
				v, av, ev := b2[d], math.Abs(b2[d]), 0.0
				for j := range H {
					v += h[l][j] * w2[j*D+d]
					av += math.Abs(h[l][j] * w2[j*D+d])
					ev += math.Abs(w2[j*D+d]) * eh[l][j]
				}
				ev += gamma(H+1) * av
				a[l+1][d] = a[l][d] + v
				ea[l+1][d] = ea[l][d] + ev + u*math.Abs(a[l+1][d])
			}
		}
		// loss ½·mean(r²); dL/da_L = r/N, N = B·D (the graph's N and zero's
		// 1/(W·G) multiply to it, powers of two)
		for d := range D {
			r := a[L][d] - float64(y32[s*D+d])
			er := ea[L][d] + u*math.Abs(r)
			o.loss += 0.5 * r * r / N
			sumAbsR2 += 0.5 * r * r / N
			sumRErr += math.Abs(r) * er / N
			// per-sample terms are kept unscaled by 1/N; scaled at the end
			delta[d] = r
			edelta[d] = er + 3*u*math.Abs(r) // Square's VJP 2·r·(½·v): three products
		}
		for l := L - 1; l >= 0; l-- {
			w1, w2 := w[4*l], w[4*l+2]
			gw1, gb1, gw2, gb2 := 4*l, 4*l+1, 4*l+2, 4*l+3
			for j := range H {
				for d := range D {
					t := h[l][j] * delta[d]
					o.grad[gw2][j*D+d] += t
					abs[gw2][j*D+d] += math.Abs(t)
					o.err[gw2][j*D+d] += math.Abs(h[l][j])*edelta[d] + eh[l][j]*math.Abs(delta[d]) + u*math.Abs(t)
				}
			}
			for d := range D {
				o.grad[gb2][d] += delta[d]
				abs[gb2][d] += math.Abs(delta[d])
				o.err[gb2][d] += edelta[d]
			}
			for j := range H {
				v, av, ev := 0.0, 0.0, 0.0
				for d := range D {
					v += w2[j*D+d] * delta[d]
					av += math.Abs(w2[j*D+d] * delta[d])
					ev += math.Abs(w2[j*D+d]) * edelta[d]
				}
				ev += gamma(D) * av
				q := 1 - h[l][j]*h[l][j]
				eq := 2*math.Abs(h[l][j])*eh[l][j] + u*h[l][j]*h[l][j] + u*math.Abs(q)
				dz[j] = v * q
				edz[j] = math.Abs(q)*ev + math.Abs(v)*eq + u*math.Abs(dz[j])
			}
			for k := range D {
				for j := range H {
					t := a[l][k] * dz[j]
					o.grad[gw1][k*H+j] += t
					abs[gw1][k*H+j] += math.Abs(t)
					o.err[gw1][k*H+j] += math.Abs(a[l][k])*edz[j] + ea[l][k]*math.Abs(dz[j]) + u*math.Abs(t)
				}
			}
			for j := range H {
				o.grad[gb1][j] += dz[j]
				abs[gb1][j] += math.Abs(dz[j])
				o.err[gb1][j] += edz[j]
			}
			if l == 0 {
				break
			}
			for k := range D { // the gradient by a_l: the residual path plus the block's
				v, av, ev := delta[k], math.Abs(delta[k]), edelta[k]
				for j := range H {
					v += w1[k*H+j] * dz[j]
					av += math.Abs(w1[k*H+j] * dz[j])
					ev += math.Abs(w1[k*H+j]) * edz[j]
				}
				delta[k] = v
				edelta[k] = ev + gamma(H+1)*av
			}
		}
	}
	for p := range o.grad {
		for i := range o.grad[p] {
			o.grad[p][i] /= N
			abs[p][i] /= N
			o.rowErr[p][i] = o.err[p][i] / N * (1 + 1e-9) // float64's own rounding
			o.err[p][i] = o.rowErr[p][i] + gamma(nb)*abs[p][i]
		}
	}
	// the loss is one mean over B·D squares in the reference's graph (over
	// B·D/(W·G) in zero's, then W·G partial means in float64)
	o.lossErr = sumRErr + gamma(B*D+c.world*c.accum+4)*sumAbsR2
	return o
}
