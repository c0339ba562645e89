package zero

import (
	"bytes"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestEveryExportedIdentifierHasADoc: functions, methods, types, constants,
// variables and struct fields that the package exports, in every build
// variant's files, carry a comment.
func TestEveryExportedIdentifierHasADoc(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		missing := func(pos token.Pos, what string) {
			t.Errorf("%s: %s has no doc comment", fset.Position(pos), what)
		}
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() || d.Doc != nil {
					continue
				}
				if d.Recv != nil && !exportedReceiver(d.Recv) {
					continue
				}
				missing(d.Pos(), d.Name.Name)
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					switch s := spec.(type) {
					case *ast.TypeSpec:
						if !s.Name.IsExported() {
							continue
						}
						if s.Doc == nil && d.Doc == nil {
							missing(s.Pos(), "type "+s.Name.Name)
						}
						if st, ok := s.Type.(*ast.StructType); ok {
							for _, fld := range st.Fields.List {
								for _, n := range fld.Names {
									if n.IsExported() && fld.Doc == nil && fld.Comment == nil {
										missing(n.Pos(), s.Name.Name+"."+n.Name)
									}
								}
							}
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							// a constant in a documented group with a line comment or
							// the group's doc counts as documented
							if n.IsExported() && s.Doc == nil && s.Comment == nil && d.Doc == nil {
								missing(n.Pos(), n.Name)
							}
						}
					}
				}
			}
		}
	}
}

func exportedReceiver(recv *ast.FieldList) bool {
	typ := recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	id, ok := typ.(*ast.Ident)
	return ok && id.IsExported()
}

// TestReadmeQuotesTheExample: the README's program is example_test.go's
// Example, word for word, so the README's code compiles and runs.
func TestReadmeQuotesTheExample(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	body := string(src[bytes.Index(src, []byte("func Example()")):])
	if !strings.Contains(string(readme), "```go\n"+strings.TrimRight(body, "\n")+"\n```") {
		t.Error("README.md does not quote example_test.go from func Example() to its end; copy it into the README's Use it section")
	}
}
