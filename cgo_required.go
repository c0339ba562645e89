//go:build !cgo

package zero

// zero's kernels are C, compiled through cgo. This file builds only with
// cgo off. The undefined name below is the error the compiler shows, and it
// sits in a type declaration so that it is the first: type declarations are
// checked before everything else, and this file's before the others'.
type needsCgo zero_needs_cgo__build_with_CGO_ENABLED_1_and_a_C_compiler_such_as_gcc
