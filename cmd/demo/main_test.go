package main

import (
	"io"
	"testing"
)

// TestTableInvariants runs a tiny table and checks what its rows must
// show: N reduce-scatters per bucket without a window at stages 2 and 3,
// one with it; no_sync's collectives equal coalesce's; a budget gives
// local + N × streamed; a window holds at least the baseline's memory.
func TestTableInvariants(t *testing.T) {
	const n = 2
	for _, overlap := range []bool{true, false} {
		o := options{world: 2, layers: 2, hidden: 64, ns: []int{n}, stages: []int{1, 2, 3}, modes: allModes, steps: 1, rounds: 1, overlap: overlap}
		rows, err := runTable(o, newModel(o.layers, o.hidden), io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		get := func(stage int, mode string) Row {
			for _, r := range rows {
				if r.Stage == stage && r.Mode == mode {
					return r
				}
			}
			t.Fatalf("no row for stage %d %s", stage, mode)
			return Row{}
		}
		for _, stage := range o.stages {
			base, ns, co, bud := get(stage, baseline), get(stage, noSync), get(stage, coalesce), get(stage, coalesceBudget)
			b := int64(base.Buckets)
			if b != 2 {
				t.Fatalf("stage %d: %d buckets, want one per layer (2)", stage, b)
			}
			wantBase := n * b
			if stage == 1 {
				wantBase = b // ZeRO-1 reduces once per step anyway
			}
			if base.ReduceScatters != wantBase || co.ReduceScatters != b {
				t.Errorf("overlap %v stage %d: %d reduce-scatters without a window, %d with, want %d and %d",
					overlap, stage, base.ReduceScatters, co.ReduceScatters, wantBase, b)
			}
			if ns.ReduceScatters != co.ReduceScatters || ns.AllReduces != co.AllReduces || ns.AllGathers != co.AllGathers || ns.GradPayloadBytes != co.GradPayloadBytes {
				t.Errorf("overlap %v stage %d: no_sync %s (%d B), coalesce %s (%d B)", overlap, stage, collectives(ns), ns.GradPayloadBytes, collectives(co), co.GradPayloadBytes)
			}
			local := int64(bud.LocalBuckets)
			if local <= 0 || local >= b {
				t.Fatalf("stage %d: the budget makes %d of %d buckets local; the test wants some of each", stage, local, b)
			}
			if want := local + n*(b-local); stage > 1 && bud.ReduceScatters != want {
				t.Errorf("overlap %v stage %d budget: %d reduce-scatters, want %d local + %d × %d streamed", overlap, stage, bud.ReduceScatters, local, n, b-local)
			}
			for _, r := range []Row{base, ns, co, bud} {
				if r.AllReduces != 1 {
					t.Errorf("overlap %v stage %d %s: %d all-reduces, want Step's window check only", overlap, stage, r.Mode, r.AllReduces)
				}
				if (r.AllGathers > 0) != (stage == 3) {
					t.Errorf("overlap %v stage %d %s: %d all-gathers", overlap, stage, r.Mode, r.AllGathers)
				}
				if r.Mode != baseline && (!r.WindowResidentMeasured || r.WindowResidentBytes < base.WindowResidentBytes) {
					t.Errorf("overlap %v stage %d %s: window resident %d B, baseline %d B", overlap, stage, r.Mode, r.WindowResidentBytes, base.WindowResidentBytes)
				}
				if r.PeakBytes < r.FlushResidentBytes || r.MaxErr > 1e-2 {
					t.Errorf("overlap %v stage %d %s: peak %d B, resident %d B, max err %.1e", overlap, stage, r.Mode, r.PeakBytes, r.FlushResidentBytes, r.MaxErr)
				}
			}
		}
	}
}
