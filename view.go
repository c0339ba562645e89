package zero

// View is one parameter's part of one of this rank's shard buffers (today
// the reduced gradient), where the plan puts it. The buffer may be device
// memory, so a View is read and written by copies on the engine's stream.
type View struct {
	Param int // the parameter's index at registration
	ShardRange
	e     *Engine
	buf   Tensor // the whole shard buffer
	check func(op string) error
	scale func() float32 // read value = stored value × scale
}

// GradView returns parameter param's part of this rank's reduced fp32
// gradient shard. Read gives the same values as GradShard and FullGrads
// (the mean's 1/G applied); both Read and Write are refused while a
// backward of the next window is under way.
func (e *Engine) GradView(param int) (View, error) {
	if err := e.usable("GradView"); err != nil {
		return View{}, err
	}
	rg, err := e.plan.ShardRange(param, e.rank)
	if err != nil {
		return View{}, err
	}
	return View{Param: param, ShardRange: rg, e: e, buf: e.pl.shard, check: e.readable,
		scale: func() float32 { return e.readScale }}, nil
}

// Read copies the view's Count elements into dst.
func (v View) Read(dst []float32) error {
	if err := v.prepare("View.Read", len(dst)); err != nil {
		return err
	}
	d, s := v.e.shardSide(v.e.copyStream)
	return v.e.copyScaled(d, s, Float32s(dst), v.buf.slice(v.ShardOffset, v.Count), v.scale())
}

// Write stores src (Count elements) in the view, so that Read gives src
// back: exactly where the read scale is a power of two, within one
// rounding elsewhere.
func (v View) Write(src []float32) error {
	if err := v.prepare("View.Write", len(src)); err != nil {
		return err
	}
	d, s := v.e.shardSide(v.e.copyStream)
	return v.e.copyScaled(d, s, v.buf.slice(v.ShardOffset, v.Count), Float32s(src), float32(1/float64(v.scale())))
}

func (v View) prepare(op string, n int) error {
	if v.e == nil {
		return errorf(ErrParam, "%s on a zero View; get one from GradView", op)
	}
	if err := v.check(op); err != nil {
		return err
	}
	if n != v.Count {
		return errorf(ErrGradSize, "%s of %d elements; parameter %d has %d elements on rank %d (View.Count)", op, n, v.Param, v.Count, v.e.rank)
	}
	return nil
}
