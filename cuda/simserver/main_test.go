package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"
)

func TestBadUsageExitsTwoNamingTheFlag(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no socket", nil, "usage: simserver -socket PATH"},
		{"an extra argument", []string{"-socket", sock, "extra"}, "usage: simserver"},
		{"memory that is not a quantity", []string{"-socket", sock, "-memory", "lots"}, `-memory "lots"`},
		{"more memory than the device", []string{"-socket", sock, "-memory", "41GiB"}, "must be between 1MiB and 40GiB"},
		{"an unknown flag", []string{"-gpus", "2"}, "flag provided but not defined: -gpus"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			if code := run(tc.args, &stderr); code != 2 {
				t.Errorf("got exit code %d, want 2", code)
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Errorf("stderr %q does not contain %q", stderr.String(), tc.want)
			}
		})
	}
}

func TestASocketThatCannotBeCreatedExitsOne(t *testing.T) {
	var stderr bytes.Buffer
	if code := run([]string{"-socket", filepath.Join(t.TempDir(), "no", "dir")}, &stderr); code != 1 {
		t.Errorf("got exit code %d, want 1; stderr %q", code, stderr.String())
	}
}
