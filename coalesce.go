package zero

import "errors"

// Coalesced windows and NoSync: several backwards, then one reduction per
// bucket instead of one per backward. Inside a window the buckets run in
// the pipeline's local mode (fp32 sums at full size, as ZeRO-1's), so the
// arithmetic is ZeRO-1's: a local sum, then one reduction. With
// CoalesceBudgetBytes, only the buckets backward produces last are local,
// as many as fit; the others stay streamed.

// coalesceState is the window the engine is in.
type coalesceState struct {
	active    bool // inside BeginCoalesce/EndCoalesce
	noSync    bool // inside BeginNoSync/EndNoSync
	flushNext bool // NoSync ended: the next backward reduces (DDP's rule)
	// resident is the gradient memory held when the window's last backward
	// ended, before its flush, for the stats.
	resident int64
}

// localInWindow picks the buckets a window makes local: from the last
// produced (the highest index) down, while their accumulators (WindowDType)
// fit the budget (0: every bucket). The plan is the same on every rank, so
// the choice is too.
func (e *Engine) localInWindow() []bool {
	inWindow := make([]bool, len(e.plan.Buckets))
	budget := int64(e.cfg.Window.BudgetBytes)
	used := int64(0)
	for b := len(inWindow) - 1; b >= 0; b-- {
		size := int64(e.plan.Buckets[b].Elems) * 4
		if e.pl.spec.modes[b] != local {
			size = int64(e.plan.Buckets[b].Elems * e.cfg.Window.DType.Size())
		}
		if budget > 0 && used+size > budget {
			break
		}
		used += size
		inWindow[b] = true
	}
	return inWindow
}

// setWindowModes makes the window's buckets local, or (on) restores every
// bucket's own mode.
func (e *Engine) setWindowModes(on bool) {
	var inWindow []bool
	if on {
		inWindow = e.localInWindow()
	}
	for b := range e.pl.buckets {
		mode := e.pl.spec.modes[b]
		if on && inWindow[b] {
			mode = local
		}
		e.pl.buckets[b].mode = mode
	}
}

func (e *Engine) checkWindowStart(op string) error {
	if err := e.usable(op); err != nil {
		return err
	}
	switch {
	case e.inBackward:
		return errorf(ErrProtocol, "%s inside a backward; call it between backwards", op)
	case e.co.active:
		return errorf(ErrProtocol, "%s inside a Coalesce window; windows do not nest", op)
	case e.co.noSync:
		return errorf(ErrProtocol, "%s inside NoSync; end NoSync first", op)
	case e.co.flushNext:
		return errorf(ErrProtocol, "%s right after NoSync; the backward after NoSync reduces, take it first (or Step)", op)
	}
	return nil
}

// checkWindowEnd refuses op where its window is not open or a backward is.
func (e *Engine) checkWindowEnd(op string, open bool, begin string) error {
	if err := e.usable(op); err != nil {
		return err
	}
	switch {
	case !open:
		return errorf(ErrProtocol, "%s without %s", op, begin)
	case e.inBackward:
		return errorf(ErrProtocol, "%s inside a backward; call EndBackward first", op)
	}
	return nil
}

// BeginCoalesce opens a coalesced window: the backwards until EndCoalesce
// sum their gradients locally, and EndCoalesce reduces each bucket once.
// It works at every stage; at stage 1, whose buckets are local anyway, it
// only makes the reduction happen at EndCoalesce.
func (e *Engine) BeginCoalesce() error {
	if err := e.checkWindowStart("BeginCoalesce"); err != nil {
		return err
	}
	e.setWindowModes(true)
	e.co.active = true
	return nil
}

// EndCoalesce closes the window: each local bucket is reduced exactly once
// into the shard, on the engine's stream, and the modes return to the
// stage's. It acts as a boundary: Step may follow at once.
func (e *Engine) EndCoalesce() error {
	if err := e.checkWindowEnd("EndCoalesce", e.co.active, "BeginCoalesce"); err != nil {
		return err
	}
	e.co.resident = e.pl.mem.cur
	if err := e.pl.flushLocal(e.reduceStream); err != nil {
		return e.fail(err)
	}
	e.setWindowModes(false)
	e.co.active = false
	return nil
}

// Coalesce runs fn, which takes several backwards, inside a coalesced
// window; fn's error, or the window's, is returned. The window always
// closes: when fn fails, every gradient taken since the last Step is
// dropped, as DiscardGrads drops them, and the window ends without
// reducing (every rank must see the failure, as with any failed step).
func (e *Engine) Coalesce(fn func() error) error {
	return e.within(e.BeginCoalesce, fn, e.EndCoalesce, &e.co.active)
}

// within runs fn between begin and end. When fn fails it drops the
// window's gradients and closes the window (open) instead of ending it.
func (e *Engine) within(begin, fn, end func() error, open *bool) error {
	if err := begin(); err != nil {
		return err
	}
	if err := fn(); err != nil {
		discarded := e.DiscardGrads()
		if *open {
			e.setWindowModes(false)
			*open = false
		}
		return errors.Join(err, discarded)
	}
	return end()
}

// BeginNoSync starts backwards that only accumulate, as DDP's no_sync: at
// every stage (DeepSpeed refuses it at 2 and 3), with the coalesced
// window's mechanism. The first backward after EndNoSync reduces what they
// accumulated together with its own gradients, each bucket once; a Step
// right after EndNoSync reduces it too.
func (e *Engine) BeginNoSync() error {
	if err := e.checkWindowStart("BeginNoSync"); err != nil {
		return err
	}
	e.setWindowModes(true)
	e.co.noSync = true
	return nil
}

// EndNoSync ends the backwards that only accumulate.
func (e *Engine) EndNoSync() error {
	if err := e.checkWindowEnd("EndNoSync", e.co.noSync, "BeginNoSync"); err != nil {
		return err
	}
	e.co.noSync = false
	e.co.flushNext = true
	return nil
}

// NoSync runs fn's backwards without reducing them, as BeginNoSync and
// EndNoSync around it. When fn fails, NoSync ends, and every gradient taken
// since the last Step is dropped, as Coalesce does.
func (e *Engine) NoSync(fn func() error) error {
	return e.within(e.BeginNoSync, fn, e.EndNoSync, &e.co.noSync)
}

// afterFlush ends a NoSync's reduction: the modes return to the stage's.
func (e *Engine) afterFlush() {
	if e.co.flushNext {
		e.setWindowModes(false)
		e.co.flushNext = false
	}
}
