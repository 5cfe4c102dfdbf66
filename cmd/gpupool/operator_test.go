package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestOperatorCommandsRefuseBadInput(t *testing.T) {
	prev := stdinIsTerminal
	stdinIsTerminal = func(io.Reader) bool { return false }
	t.Cleanup(func() { stdinIsTerminal = prev })

	dir := t.TempDir()
	snap := filepath.Join(dir, "backup.snap")
	if err := os.WriteFile(snap, []byte("snapshot"), 0o600); err != nil {
		t.Fatal(err)
	}
	checkUsageErrors(t, []usageCase{
		{"peers with a positional argument", []string{"operator", "raft", "peers", "b1"}, []string{"accepts 0 arg(s), received 1"}},
		{"remove-peer without a server", []string{"operator", "raft", "remove-peer"}, []string{"accepts 1 arg(s), received 0", "remove-peer SERVER_ID"}},
		{"transfer-leadership with an empty --to", []string{"operator", "raft", "transfer-leadership", "--to", ""}, []string{"--to is empty", "raft peers"}},
		{"transfer-leadership with a positional server", []string{"operator", "raft", "transfer-leadership", "b2"}, []string{"accepts 0 arg(s)", "[--to SERVER_ID]"}},
		{"snapshot save without a file", []string{"operator", "snapshot", "save"}, []string{"accepts 1 arg(s), received 0", "save FILE"}},
		{"snapshot save into a missing directory", []string{"operator", "snapshot", "save", filepath.Join(dir, "nope", "x.snap")}, []string{"does not exist"}},
		{"snapshot save onto a directory", []string{"operator", "snapshot", "save", dir}, []string{"is a directory", "gpupool.snap"}},
		{"snapshot restore without a file", []string{"operator", "snapshot", "restore"}, []string{"accepts 1 arg(s), received 0", "restore FILE"}},
		{"snapshot restore of a missing file", []string{"operator", "snapshot", "restore", filepath.Join(dir, "missing.snap")}, []string{"no such file"}},
		{"snapshot restore of a directory", []string{"operator", "snapshot", "restore", dir, "--yes"}, []string{"is a directory"}},
		{"snapshot restore without --yes off a terminal", []string{"operator", "snapshot", "restore", snap}, []string{"not a terminal", "--yes"}},
		{"snapshot restore with a bad -o", []string{"operator", "snapshot", "restore", snap, "--yes", "-o", "yaml"}, []string{`--output "yaml"`}},
	})
}

func TestPrintRaftPeers(t *testing.T) {
	var buf bytes.Buffer
	err := printRaftPeers(&buf, &gpupoolv1.RaftPeersResponse{Peers: []*gpupoolv1.RaftPeer{
		{Id: "b1", RaftAddress: "127.0.0.1:7642", RpcAddress: "127.0.0.1:7641", Leader: true, Voter: true},
		{Id: "b2", RaftAddress: "127.0.0.1:7644", RpcAddress: "127.0.0.1:7643", Voter: false},
	}})
	if err != nil {
		t.Fatal(err)
	}
	want := "ID  RAFT ADDRESS    RPC ADDRESS     ROLE      VOTER\n" +
		"b1  127.0.0.1:7642  127.0.0.1:7641  leader    yes\n" +
		"b2  127.0.0.1:7644  127.0.0.1:7643  follower  no\n"
	if buf.String() != want {
		t.Errorf("got\n%s\nwant\n%s", buf.String(), want)
	}
}

func TestConfirm(t *testing.T) {
	tests := []struct {
		answer string
		want   bool
	}{
		{"y\n", true},
		{"YES\n", true},
		{" yes ", true},
		{"n\n", false},
		{"\n", false},
		{"", false},
		{"sure\n", false},
	}
	for _, tt := range tests {
		var prompt bytes.Buffer
		got, err := confirm(strings.NewReader(tt.answer), &prompt, "Replace?")
		if err != nil || got != tt.want {
			t.Errorf("confirm(%q) = %v, %v; want %v", tt.answer, got, err, tt.want)
		}
		if prompt.String() != "Replace? [y/N]: " {
			t.Errorf("prompt %q, want %q", prompt.String(), "Replace? [y/N]: ")
		}
	}
}

func TestPrintSnapshotSaved(t *testing.T) {
	setOutput(t, "table")
	var buf bytes.Buffer
	if err := printSnapshotSaved(&buf, snapshotSaved{File: "b.snap", Bytes: 1234, Index: 56}); err != nil {
		t.Fatal(err)
	}
	if got, want := buf.String(), "saved 1234 bytes to b.snap (raft index 56)\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	setOutput(t, "json")
	buf.Reset()
	if err := printSnapshotSaved(&buf, snapshotSaved{File: "b.snap", Bytes: 1234}); err != nil {
		t.Fatal(err)
	}
	if got, want := buf.String(), "{\n  \"file\": \"b.snap\",\n  \"bytes\": 1234\n}\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestPrintKeys(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	var buf bytes.Buffer
	keys := []*gpupoolv1.PublicKey{{Id: "k-new", PublicKey: []byte{1, 2, 3}}, {Id: "k-old", PublicKey: []byte{4}, VerifyUntilMs: now.Add(61 * time.Minute).UnixMilli()}}
	if err := printKeys(&buf, keys, now); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"k-new  signing", "k-old  verifies for 61m", "AQID"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("printKeys output lacks %q:\n%s", want, buf.String())
		}
	}
}

func TestKeysCommandsRefuseBadInput(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"rotate with an argument", []string{"operator", "keys", "rotate", "now"}, []string{"accepts 0 arg(s), received 1"}},
		{"ls with a bad -o", []string{"operator", "keys", "ls", "-o", "yaml"}, []string{`--output "yaml"`}},
		{"an unknown keys command", []string{"operator", "keys", "revoke"}, []string{"revoke"}},
	})
}
