package broker

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// TestOnlyTheBoundaryMakesGRPCStatuses keeps errors.go the one place
// where errors meet gRPC codes: no other product file under broker/ may
// call status.Error, status.Errorf, status.New or status.Newf.
func TestOnlyTheBoundaryMakesGRPCStatuses(t *testing.T) {
	fset := token.NewFileSet()
	var offenders []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || path == "errors.go" {
			return err
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		name := "" // what the file calls google.golang.org/grpc/status
		for _, im := range f.Imports {
			if im.Path.Value == `"google.golang.org/grpc/status"` {
				name = "status"
				if im.Name != nil {
					name = im.Name.Name
				}
			}
		}
		if name == "" {
			return nil
		}
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if x, ok := sel.X.(*ast.Ident); ok && x.Name == name {
				switch sel.Sel.Name {
				case "Error", "Errorf", "New", "Newf":
					offenders = append(offenders, fset.Position(sel.Pos()).String()+": status."+sel.Sel.Name)
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(offenders) > 0 {
		t.Fatalf("gRPC statuses made outside errors.go (return a domain error, refuse or refusef, and let toStatus map it):\n%s", strings.Join(offenders, "\n"))
	}
}
