package zero

import (
	"fmt"
	"go/ast"
	"go/importer"
	"go/types"
	"path/filepath"
	"strings"
	"testing"
)

// The package's files stand on floors. A file may use the private fields
// and methods of a lower floor's files; of a file on its own floor or a
// higher one, nothing; and of a component (componentFloor up) only methods,
// never fields, even from above: a component's state is read and changed by
// its own file alone. Interface methods are seams, open to all.
var floors = map[string]int{
	// 0: the foundation types
	"dtype.go": 0, "errors.go": 0, "doc.go": 0, "cgo_required.go": 0,
	// 1: the types that cross into C
	"kernels_abi.go": 1,
	// 2: kernels and streams
	"kernels.go": 2, "stream.go": 2, "gpu_errors.go": 2,
	// 3: devices and their memory
	"device.go": 3, "cuda.go": 3, "cuda_stub.go": 3, "nvml.go": 3,
	// 4: what lives on a device: pools, page-locked memory, collectives;
	// the bootstrap of a group
	"pool.go": 4, "pinned.go": 4, "nccl.go": 4, "bootstrap.go": 4,
	// the checkpoint's file layer, its rank files, its manifest's layout
	// and the lock of its directory; the safetensors
	// format and the import of a model from it
	"ckptfs.go": 4, "ckptfile.go": 4, "ckptlayout.go": 4, "ckptlock.go": 4, "safetensors.go": 4,
	// 5: the communicators
	"group_local.go": 5, "group_cuda.go": 5, "nccl_cuda.go": 5, "mpi.go": 5,
	// 6: the caller's words and what the engine reports back
	"config.go": 6, "stats.go": 6, "view.go": 6, "schedule.go": 6, "dsconfig.go": 6,
	// (the shard's sums of squares, which the sinks keep)
	"norm.go": 6,
	// 7: the plan and the pipeline
	"bucket.go": 7,
	// 8: the components the pipeline is handed or that sit beside it
	"offload.go": 8, "optim.go": 8, "params.go": 8, "coalesce.go": 8, "agree.go": 8,
	// 9: what reads and sets every component's state: checkpoints and
	// their exports to safetensors; and the estimator, which plans as the
	// hub builds
	"checkpoint.go": 9, "estimate.go": 9,
	// 10: the hub; and a checkpoint written without an engine, which
	// commits as a save does
	"zero.go": 10, "ckptwrite.go": 10,
}

// componentFloor is the first floor whose files are components: their
// fields are read by their own file alone, whatever the floor of the
// reader.
const componentFloor = 6

// ownershipAllowed are the exceptions, each with its reason:
// "using file -> declaring file: Type.member".
var ownershipAllowed = map[string]string{}

// TestOwnership holds the package to its floors (see floors), in the
// default build and with -tags cuda: no file reads a private field, or
// calls a private method, that another component's file declares, but for
// the allowed exceptions.
func TestOwnership(t *testing.T) {
	withoutRace(t)
	seen := map[string]bool{}
	for _, tags := range [][]string{nil, {"cuda"}} {
		fset, files := parsePackage(t, tags)
		for _, f := range files {
			name := filepath.Base(fset.Position(f.Pos()).Filename)
			if _, ok := floors[name]; !ok {
				t.Errorf("%s stands on no floor: add it to floors in ownership_test.go", name)
			}
		}
		info := &types.Info{Selections: map[*ast.SelectorExpr]*types.Selection{}}
		conf := types.Config{FakeImportC: true, Importer: importer.Default(), Error: func(error) {}}
		conf.Check("zero", fset, files, info)
		for expr, sel := range info.Selections {
			obj := sel.Obj()
			if obj.Exported() || obj.Pkg() == nil || obj.Pkg().Path() != "zero" || isInterfaceMethod(obj) {
				continue
			}
			use := filepath.Base(fset.Position(expr.Pos()).Filename)
			decl := filepath.Base(fset.Position(obj.Pos()).Filename)
			if use == decl {
				continue
			}
			uf, df := floors[use], floors[decl]
			_, field := obj.(*types.Var)
			if df < uf && (df < componentFloor || !field) {
				continue
			}
			recv := types.TypeString(sel.Recv(), func(*types.Package) string { return "" })
			key := fmt.Sprintf("%s -> %s: %s.%s", use, decl, strings.TrimPrefix(recv, "*"), obj.Name())
			if _, ok := ownershipAllowed[key]; ok || seen[key] {
				seen[key] = true
				continue
			}
			seen[key] = true
			kind := "calls the private method"
			if field {
				kind = "reads the private field"
			}
			t.Errorf("%s %s %s.%s of %s (floor %d, %s on floor %d): ask its owner through a method, or allow it in ownershipAllowed with a reason",
				use, kind, recv, obj.Name(), decl, df, use, uf)
		}
	}
	for key := range ownershipAllowed {
		if !seen[key] {
			t.Errorf("ownershipAllowed holds %q, which no file does any more: drop it", key)
		}
	}
}

func isInterfaceMethod(obj types.Object) bool {
	fn, ok := obj.(*types.Func)
	if !ok {
		return false
	}
	recv := fn.Type().(*types.Signature).Recv()
	if recv == nil {
		return false
	}
	_, iface := recv.Type().Underlying().(*types.Interface)
	return iface
}
