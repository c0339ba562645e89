package zero

// Coalesced windows and NoSync: several backwards, then one reduction per
// bucket instead of one per backward. Inside a window the buckets run in
// the pipeline's deferred mode (sums at full size, as ZeRO-1's), so the
// arithmetic is ZeRO-1's: a local sum, then one reduction. With
// Window.BudgetBytes, only the buckets backward produces last are deferred,
// as many as fit; the others stay streamed.

// window is the window the engine is in.
type window struct {
	pl        *pipeline
	plan      *Plan
	budget    int64 // Window.BudgetBytes (0: every bucket is deferred)
	active    bool  // inside BeginCoalesce/EndCoalesce
	noSync    bool  // inside BeginNoSync/EndNoSync
	flushNext bool  // NoSync ended: the next backward reduces (DDP's rule)
	// resident and inUse are the gradient memory held and in use when the
	// window's last backward ended, before its flush, for the stats.
	resident, inUse int64
}

func newWindow(pl *pipeline, plan *Plan, cfg WindowPolicy) window {
	return window{pl: pl, plan: plan, budget: int64(cfg.BudgetBytes)}
}

// open reports whether a coalesced window or NoSync is open: Step and
// SetBoundary wait for its end.
func (w *window) open() bool { return w.active || w.noSync }

// localInWindow picks the buckets a window defers (windowLocal).
func (w *window) localInWindow() []bool {
	return windowLocal(w.plan, w.budget, w.pl.localSumOf)
}

// windowLocal picks the buckets a window defers: from the last
// produced (the highest index) down, while their sums (sum: localSum, in
// the window's dtype, ZeRO-1's own fp32 ones unpadded) fit the budget (0:
// every bucket). The plan is the same on every rank, so the choice is too.
// The estimator asks it before a pipeline exists.
func windowLocal(plan *Plan, budget int64, sum func(b int) (int, DType)) []bool {
	inWindow := make([]bool, len(plan.Buckets))
	used := int64(0)
	for b := len(inWindow) - 1; b >= 0; b-- {
		n, dt := sum(b)
		size := int64(n * dt.Size())
		if budget > 0 && used+size > budget {
			break
		}
		used += size
		inWindow[b] = true
	}
	return inWindow
}

// setModes makes the window's buckets deferred, or (off) restores every
// bucket's own mode.
func (w *window) setModes(on bool) {
	var inWindow []bool
	if on {
		inWindow = w.localInWindow()
	}
	for b := range w.plan.Buckets {
		mode := w.pl.stageMode(b)
		if on && inWindow[b] {
			mode = deferred
		}
		w.pl.setMode(b, mode)
	}
}

// checkStart refuses op (a window's start) where it cannot begin.
func (w *window) checkStart(op string, inBackward bool) error {
	switch {
	case inBackward:
		return errorf(ErrProtocol, "%s inside a backward; call it between backwards", op)
	case w.active:
		return errorf(ErrProtocol, "%s inside a Coalesce window; windows do not nest", op)
	case w.noSync:
		return errorf(ErrProtocol, "%s inside NoSync; end NoSync first", op)
	case w.flushNext:
		return errorf(ErrProtocol, "%s right after NoSync; the backward after NoSync reduces, take it first (or Step)", op)
	}
	return nil
}

// checkEnd refuses op where its window is not open or a backward is.
func (w *window) checkEnd(op string, open bool, begin string, inBackward bool) error {
	switch {
	case !open:
		return errorf(ErrProtocol, "%s without %s", op, begin)
	case inBackward:
		return errorf(ErrProtocol, "%s inside a backward; call EndBackward first", op)
	}
	return nil
}

// checkEndCoalesce and checkEndNoSync refuse an end where its window is
// not open or a backward is.
func (w *window) checkEndCoalesce(inBackward bool) error {
	return w.checkEnd("EndCoalesce", w.active, "BeginCoalesce", inBackward)
}

func (w *window) checkEndNoSync(inBackward bool) error {
	return w.checkEnd("EndNoSync", w.noSync, "BeginNoSync", inBackward)
}

// startsFlush reports whether a backward that begins now reduces what
// NoSync accumulated (DDP's rule: the backward after no_sync).
func (w *window) startsFlush() bool { return w.flushNext }

// begin opens a coalesced window, or NoSync.
func (w *window) begin(noSync bool) {
	w.setModes(true)
	w.active, w.noSync = !noSync, noSync
}

// endCoalesce reduces each deferred bucket once, on rs, and restores the
// modes.
func (w *window) endCoalesce(rs Stream) error {
	w.resident, w.inUse = w.pl.residentBytes()
	if err := w.pl.flushLocal(rs); err != nil {
		return err
	}
	w.setModes(false)
	w.active = false
	return nil
}

// endNoSync ends NoSync: the next backward reduces what it accumulated.
func (w *window) endNoSync() {
	w.resident, w.inUse = w.pl.residentBytes()
	w.noSync = false
	w.flushNext = true
}

// abandon closes whatever is open without reducing (its gradients were
// dropped).
func (w *window) abandon() {
	if w.open() {
		w.setModes(false)
	}
	w.active, w.noSync = false, false
}

// flushing reports whether NoSync ended and its flush is still to come.
func (w *window) flushing() bool { return w.flushNext }

// afterFlush ends a NoSync's reduction: the modes return to the stage's.
func (w *window) afterFlush() {
	if w.flushNext {
		w.setModes(false)
		w.flushNext = false
	}
}

// report fills the window's figures and starts the next window's.
func (w *window) report(st *Stats) error {
	st.WindowResidentBytes, st.WindowGradBytesInUse = w.resident, w.inUse
	w.resident, w.inUse = 0, 0
	return nil
}
