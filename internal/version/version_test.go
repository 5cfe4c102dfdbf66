package version

import (
	"runtime"
	"strings"
	"testing"
)

func TestStampedVersionAndCommitWin(t *testing.T) {
	defer func(v, c string) { Version, Commit = v, c }(Version, Commit)
	Version, Commit = "v1.2.3", "0123456789abcdef0123"
	got := Get()
	if got.Version != "v1.2.3" || got.Commit != "0123456789ab" || got.GoVersion != runtime.Version() {
		t.Errorf("got %+v, want v1.2.3, the commit cut to 12, %s", got, runtime.Version())
	}
	if s := got.String(); s != "v1.2.3 (commit 0123456789ab, "+runtime.Version()+")" {
		t.Errorf("String: got %q", s)
	}
}

func TestAnUnstampedBuildStillNamesAVersion(t *testing.T) {
	defer func(v, c string) { Version, Commit = v, c }(Version, Commit)
	Version, Commit = "", ""
	got := Get()
	if got.Version == "" || !strings.HasPrefix(got.GoVersion, "go") {
		t.Errorf("got %+v, want a version ((devel) at least) and the Go version", got)
	}
}
