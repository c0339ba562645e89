package zero

// View is one parameter's part of one of this rank's shard buffers (today
// the reduced gradient), where the plan puts it. The buffer may be device
// memory, so a View is read and written by copies on the engine's stream.
type View struct {
	Param int // the parameter's index at registration
	ShardRange
	rank  int
	read  func(dst []float32) error // copies the part out, the read scale applied
	write func(src []float32) error // copies src in, so that read gives it back
}

// newView is parameter param's view of rg on rank, read and written
// through the engine's copies.
func newView(param int, rg ShardRange, rank int, read func(dst []float32) error, write func(src []float32) error) View {
	return View{Param: param, ShardRange: rg, rank: rank, read: read, write: write}
}

// Read copies the view's Count elements into dst.
func (v View) Read(dst []float32) error {
	if err := v.prepare("View.Read", len(dst)); err != nil {
		return err
	}
	return v.read(dst)
}

// Write stores src (Count elements) in the view, so that Read gives src
// back: exactly where the read scale is a power of two, within one
// rounding elsewhere.
func (v View) Write(src []float32) error {
	if err := v.prepare("View.Write", len(src)); err != nil {
		return err
	}
	return v.write(src)
}

func (v View) prepare(op string, n int) error {
	if v.read == nil {
		return errorf(ErrParam, "%s on a zero View; get one from GradView", op)
	}
	if n != v.Count {
		return errorf(ErrGradSize, "%s of %d elements; parameter %d has %d elements on rank %d (View.Count)", op, n, v.Param, v.Count, v.rank)
	}
	return nil
}
