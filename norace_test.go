//go:build !race

package zero

// raceEnabled: see race_test.go.
const raceEnabled = false
