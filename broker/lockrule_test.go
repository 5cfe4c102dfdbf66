package broker

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The lock rule (doc.go): the queue decides and proposes under placeMu and
// waits for the commit outside it, as Acquire does, with what it proposed
// in flight.
func TestAnAcquireNeitherWaitsForTheQueuesGrantToCommitNorTakesItsRoom(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	beat := ts.heartbeater(t, "h1")
	full := ts.acquire(t, whole(1))
	w := ts.wait(t, "w", whole(1), time.Hour)
	pending := ts.byRequest("", "w").Id
	release := ts.faults.hold(t, func(cmd proto.Message) bool {
		g, ok := cmd.(*gpupoolv1.GrantLeaseCommand)
		return ok && g.Lease.Id == pending
	})

	ts.release(t, beat, full.Id)
	waitFor(t, "the queue's grant of w in flight", func() bool {
		return slices.ContainsFunc(ts.s.capacity.grants.snapshot(), func(l *gpupoolv1.Lease) bool { return l.Id == pending })
	})
	// The grant has not committed: an Acquire is answered now (the queue
	// does not hold placeMu), and finds the room taken by w.
	_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: whole(1)})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("acquire while the queue's grant commits: got %v, want ResourceExhausted", err)
	}
	if got := ts.leaseState(pending); got != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		t.Fatalf("w before its grant commits: got %v, want pending", got)
	}

	release()
	if l := w.granted(t); l.Id != pending {
		t.Fatalf("w granted as %s, want its pending lease %s", l.Id, pending)
	}
}

// The lock rule (doc.go): placeMu is held only inside a decide function,
// which takes it first thing and lets it go with a deferred unlock, so
// that no path can return, wait or act with it held by mistake. No
// product file unlocks it by hand.
func TestPlaceMuIsHeldOnlyInsideADecideFunctionThatDefersItsUnlock(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var offenders []string
	isPlaceMu := func(e ast.Expr, method string) bool {
		call, ok := e.(*ast.CallExpr)
		if !ok {
			return false
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok || sel.Sel.Name != method {
			return false
		}
		mu, ok := sel.X.(*ast.SelectorExpr)
		return ok && mu.Sel.Name == "placeMu"
	}
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			locks, deferred := 0, 0
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.DeferStmt:
					if isPlaceMu(n.Call, "Unlock") {
						deferred++
						return false
					}
				case *ast.CallExpr:
					if isPlaceMu(n, "Lock") {
						locks++
					}
					if isPlaceMu(n, "Unlock") {
						offenders = append(offenders, fset.Position(n.Pos()).String()+": placeMu unlocked by hand in "+fd.Name.Name)
					}
				}
				return true
			})
			if locks == 0 {
				continue
			}
			list := fd.Body.List
			if locks != 1 || deferred != 1 || len(list) < 2 {
				offenders = append(offenders, fset.Position(fd.Pos()).String()+": "+fd.Name.Name+" takes placeMu without exactly one deferred unlock")
				continue
			}
			first, ok := list[0].(*ast.ExprStmt)
			second, ok2 := list[1].(*ast.DeferStmt)
			if !ok || !ok2 || !isPlaceMu(first.X, "Lock") || !isPlaceMu(second.Call, "Unlock") {
				offenders = append(offenders, fset.Position(fd.Pos()).String()+": "+fd.Name.Name+" must begin with placeMu.Lock(); defer placeMu.Unlock()")
			}
		}
	}
	if len(offenders) > 0 {
		t.Fatalf("placeMu outside the decide-then-act rule (decide under the lock, return the plan, act without it):\n%s", strings.Join(offenders, "\n"))
	}
}
