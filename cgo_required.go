//go:build !cgo

package zero

// zero's kernels are C, compiled through cgo. This file builds only with
// cgo off, and the undefined name below is the error the compiler shows.
var _ = zero_needs_cgo__build_with_CGO_ENABLED_1_and_a_C_compiler_such_as_gcc
