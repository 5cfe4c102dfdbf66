package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestTokenFileRefusesBadInputBeforeDialling(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "token")
	if err := os.WriteFile(good, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	checkUsageErrors(t, []usageCase{
		{"a token file that does not exist", []string{"lease", "ls", "--token-file", filepath.Join(dir, "missing")}, []string{"--token-file open " + filepath.Join(dir, "missing") + ": no such file or directory"}},
		{"an empty token file", []string{"lease", "ls", "--token-file", empty}, []string{"--token-file " + empty + ": the file is empty"}},
		{"a token file and a token", []string{"lease", "ls", "--token-file", good, "--token", "other"}, []string{"--token-file with --token (or GPUPOOL_TOKEN): give one or the other"}},
	})
	t.Setenv("GPUPOOL_ACL_TOKEN_FILE", filepath.Join(dir, "missing"))
	checkUsageErrors(t, []usageCase{
		{"GPUPOOL_ACL_TOKEN_FILE naming no file", []string{"lease", "ls"}, []string{"GPUPOOL_ACL_TOKEN_FILE open " + filepath.Join(dir, "missing")}},
	})
}
