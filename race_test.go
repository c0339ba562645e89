//go:build race

package zero

// raceEnabled: this test binary runs under the race detector. The kernels'
// sweeps then run lighter (the race detector needs the concurrency, not
// every size and ISA level, and sees nothing of the C code); make test runs
// them in full without it.
const raceEnabled = true
