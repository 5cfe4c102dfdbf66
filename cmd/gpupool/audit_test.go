package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestAuditRefusesBadInput(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"an unknown kind", []string{"operator", "audit", "--kind", "lease-granted,lease-stolen"},
			[]string{`--kind "lease-stolen": must be one of lease-granted, lease-released`, "host-drain-started", "acl-token-revoked"}},
		{"a negative limit", []string{"operator", "audit", "--limit", "-1"}, []string{"--limit -1: must be 0 (every stored entry) or more"}},
		{"a negative since", []string{"operator", "audit", "--since", "-5"}, []string{`"-5"`, "--since"}},
		{"a since that is no number", []string{"operator", "audit", "--since", "yesterday"}, []string{`"yesterday"`, "--since"}},
		{"a malformed tenant", []string{"operator", "audit", "--tenant", "Sim Team"}, []string{`--tenant "Sim Team": must be 1-63 lowercase`}},
		{"an argument", []string{"operator", "audit", "sim"}, []string{"accepts 0 arg(s), received 1", "audit [--since INDEX]"}},
		{"an unknown output", []string{"operator", "audit", "-o", "yaml"}, []string{`--output "yaml": must be table, wide, json or name`}},
	})
}

// startBroker starts a real single-server broker without ACL and returns
// its address once it leads.
func startBroker(t *testing.T) string {
	t.Helper()
	s, err := broker.New(broker.Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	c, err := client.Dial([]string{s.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Operator.RaftPeers(ctx, &gpupoolv1.RaftPeersRequest{})
		cancel()
		if err == nil {
			return s.Addr()
		}
		if time.Now().After(deadline) {
			t.Fatalf("broker did not start: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// cli runs the CLI against addr and fails unless it exits 0.
func cli(t *testing.T, addr string, args ...string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	if code := run(append([]string{"--addr", addr}, args...), &out, &errOut); code != 0 {
		t.Fatalf("gpupool %s: exit %d: %s", strings.Join(args, " "), code, errOut.String())
	}
	return out.String()
}

// syncBuffer is a bytes.Buffer safe to write and read at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestAuditShowsWhoChangedAQuotaAndFollows(t *testing.T) {
	addr := startBroker(t)
	cli(t, addr, "operator", "quota", "set", "sim", "--gpus", "2")

	out := cli(t, addr, "operator", "audit")
	t.Logf("gpupool operator audit:\n%s", out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "TIME") || !strings.Contains(lines[0], "INDEX  KIND") {
		t.Fatalf("got\n%s\nwant a header and one entry", out)
	}
	for _, w := range []string{"quota-set", "anonymous", "sim", "gpus 2, memory unlimited, compute unlimited"} {
		if !strings.Contains(lines[1], w) {
			t.Errorf("row %q: want it to mention %q", lines[1], w)
		}
	}
	if out := cli(t, addr, "operator", "audit", "--kind", "lease-granted"); strings.Contains(out, "quota-set") {
		t.Errorf("--kind lease-granted printed a quota entry:\n%s", out)
	}

	var entries []map[string]any
	if err := json.Unmarshal([]byte(cli(t, addr, "operator", "audit", "-o", "json")), &entries); err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0]["kind"] != "AUDIT_KIND_QUOTA_SET" || entries[0]["subject"] != "sim" {
		t.Fatalf("-o json: got %v, want the one quota-set entry of sim", entries)
	}

	// --follow prints the stored entry, then a new one, until cancelled.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var followed syncBuffer
	root := newRootCmd()
	root.SetArgs([]string{"--addr", addr, "operator", "audit", "--follow"})
	root.SetOut(&followed)
	root.SetErr(&followed)
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()
	waitOutput := func(n int) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for strings.Count(followed.String(), "quota-set") < n {
			if time.Now().After(deadline) {
				t.Fatalf("follow printed\n%s\nwant %d quota-set rows", followed.String(), n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitOutput(1)
	cli(t, addr, "operator", "quota", "set", "sim", "--gpus", "3")
	waitOutput(2)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("follow ended with %v, want nil on cancel", err)
	}
	if got := followed.String(); !strings.Contains(got, "gpus 3") || strings.Count(got, "TIME") != 1 {
		t.Fatalf("follow printed\n%s\nwant one header and the new quota of 3 GPUs", got)
	}
}
