// Package version names the build of this binary: its version and commit,
// stamped by `make build` from git with -ldflags -X, and the Go release it
// was built with.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Stamped at link time:
//
//	go build -ldflags "-X github.com/gpupool/gpupool/internal/version.Version=v1.2.3 \
//	  -X github.com/gpupool/gpupool/internal/version.Commit=0123abc"
//
// A binary built without them (go build, go test) falls back to what the Go
// toolchain recorded: the module version and the VCS revision, if any.
var (
	Version = ""
	Commit  = ""
)

// Info is the build of this binary.
type Info struct {
	Version   string `json:"version"`
	Commit    string `json:"commit"`
	GoVersion string `json:"go_version"`
}

// Get returns this binary's build. Version is never empty: "(devel)" for
// an unstamped build outside a module version.
func Get() Info {
	in := Info{Version: Version, Commit: Commit, GoVersion: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if in.Version == "" && bi.Main.Version != "" {
			in.Version = bi.Main.Version
		}
		if in.Commit == "" {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" {
					in.Commit = s.Value
				}
			}
		}
	}
	if in.Version == "" {
		in.Version = "(devel)"
	}
	if len(in.Commit) > 12 {
		in.Commit = in.Commit[:12]
	}
	return in
}

// String is the one-line form, e.g. "v0.3.0 (commit 1a2b3c4d5e6f, go1.26.1)".
func (i Info) String() string {
	c := i.Commit
	if c == "" {
		c = "unknown"
	}
	return fmt.Sprintf("%s (commit %s, %s)", i.Version, c, i.GoVersion)
}
