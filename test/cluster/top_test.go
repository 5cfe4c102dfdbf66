package cluster_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// tmux drives terminal programs in a private tmux server: send-keys to
// type, capture-pane to read the screen.
type tmux struct {
	t    *testing.T
	sock string
}

// newTmux starts nothing yet; the server starts with the first session
// and is killed when the test ends. Without tmux the test fails under CI
// (the Makefile installs it) and is skipped elsewhere.
func newTmux(t *testing.T, dir string) *tmux {
	t.Helper()
	if _, err := exec.LookPath("tmux"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("tmux is not installed: 'make test' installs it (Debian tmux)")
		}
		t.Skip("tmux is not installed; 'make tmux' installs it (Debian tmux)")
	}
	tm := &tmux{t: t, sock: dir + "/tmux.sock"}
	t.Cleanup(func() { exec.Command("tmux", "-S", tm.sock, "kill-server").Run() })
	return tm
}

func (tm *tmux) run(args ...string) string {
	tm.t.Helper()
	out, err := exec.Command("tmux", append([]string{"-S", tm.sock}, args...)...).CombinedOutput()
	if err != nil {
		tm.t.Fatalf("tmux %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func shellQuote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}

// start runs argv in a new detached session of width x height; the pane
// stays after the program exits, so that its exit status can be read.
func (tm *tmux) start(name string, width, height int, argv ...string) {
	tm.t.Helper()
	tm.run("new-session", "-d", "-s", name, "-x", fmt.Sprint(width), "-y", fmt.Sprint(height), shellQuote(argv))
	tm.run("set-option", "-t", name, "remain-on-exit", "on")
}

func (tm *tmux) capture(name string) string { return tm.run("capture-pane", "-p", "-t", name) }

func (tm *tmux) keys(name string, keys ...string) {
	tm.run(append([]string{"send-keys", "-t", name}, keys...)...)
}

// waitFor polls the pane until ok holds for its content.
func (tm *tmux) waitFor(name, what string, ok func(screen string) bool) string {
	tm.t.Helper()
	var screen string
	deadline := time.Now().Add(60 * time.Second)
	for {
		screen = tm.capture(name)
		if ok(screen) {
			return screen
		}
		if time.Now().After(deadline) {
			tm.t.Fatalf("%s: timed out waiting for %s; the screen:\n%s", name, what, screen)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (tm *tmux) waitText(name string, texts ...string) string {
	tm.t.Helper()
	return tm.waitFor(name, fmt.Sprintf("%q", texts), func(s string) bool {
		for _, x := range texts {
			if !strings.Contains(s, x) {
				return false
			}
		}
		return true
	})
}

func TestTopInTmuxFollowsLeasesFiltersPausesNarrowsAndObeysTheToken(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newSecureCluster(t) // TLS and ACL, as in production
	tm := newTmux(t, cl.dir)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	run := func(args ...string) string {
		t.Helper()
		out, stderr, code := gpupool(t, append(append(args, addr, "--timeout=60s"), cl.clientFlags()...)...)
		if code != 0 {
			t.Fatalf("gpupool %s: exit %d: %s", strings.Join(args, " "), code, stderr)
		}
		return out
	}
	secret := func(args ...string) string {
		t.Helper()
		var tok tokenJSON
		if err := json.Unmarshal([]byte(run(append(args, "-o", "json")...)), &tok); err != nil || tok.Secret == "" {
			t.Fatalf("gpupool %s: no secret (%v)", strings.Join(args, " "), err)
		}
		return tok.Secret
	}
	mgmt := secret("operator", "acl", "bootstrap")
	tokA := secret("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-a", "--token="+mgmt)
	tokB := secret("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-b", "--token="+mgmt)
	for i := range 2 {
		host := fmt.Sprintf("host-%d", i+1)
		agentTok := secret("operator", "acl", "token", "create", "--kind", "agent", "--host-id", host, "--token="+mgmt)
		p := cl.newAgent(i, "--token", agentTok)
		cl.agents = append(cl.agents, p)
		p.start(t)
	}
	cl.c = cl.dialWithToken(mgmt, cl.addrs...)
	cl.waitForHosts(2)
	acquire := func(token string) string {
		t.Helper()
		var l struct{ ID string }
		if err := json.Unmarshal([]byte(run("lease", "acquire", "--memory", "20GiB", "--compute", "25", "-o", "json", "--token="+token)), &l); err != nil || l.ID == "" {
			t.Fatalf("acquire: no lease id (%v)", err)
		}
		return l.ID
	}

	topArgs := func(token string) []string {
		return append([]string{binary, "top", addr, "--interval=500ms", "--token=" + token}, cl.clientFlags()...)
	}
	// The ops pane runs top under a shell that writes its exit status to a
	// file: on a loaded machine tmux was seen to lose both a dead pane's
	// status (pane_dead_status empty for a minute) and its last output.
	exitFile := filepath.Join(t.TempDir(), "top-exit")
	tm.start("ops", 120, 45, "sh", "-c", shellQuote(topArgs(mgmt))+` ; echo "$?" > `+shellQuote([]string{exitFile}))
	tm.start("live", 120, 45, topArgs(mgmt)...)
	tm.start("team-b", 120, 45, topArgs(tokB)...)
	tm.waitText("ops", "hosts 2/2 ready", "16 GPUs", "A100-SXM4-80GB", "host-1", "host-2")

	// A lease acquired from the CLI appears, with its tenant.
	a := acquire(tokA)
	b := acquire(tokB)
	screen := tm.waitText("ops", a, b, "team-a", "team-b")
	t.Logf("the ops screen:\n%s", screen)

	// The tenant key filters: team-a first (tenants cycle in order).
	tm.keys("ops", "t")
	screen = tm.waitFor("ops", "the team-a filter", func(s string) bool {
		return strings.Contains(s, "tenant team-a") && strings.Contains(s, a) && !strings.Contains(s, b)
	})
	tm.keys("ops", "t")
	tm.waitFor("ops", "the team-b filter", func(s string) bool {
		return strings.Contains(s, "tenant team-b") && strings.Contains(s, b) && !strings.Contains(s, a)
	})
	tm.keys("ops", "a")
	tm.waitText("ops", "tenant all", a, b)
	// The model key: the pool's one model, then all again.
	tm.keys("ops", "m")
	tm.waitText("ops", "model A100-SXM4-80GB")
	tm.keys("ops", "M")
	tm.waitText("ops", "model all")

	// Pause holds the screen: a lease the live screen shows does not
	// appear on the paused one until it resumes.
	tm.keys("ops", "p")
	tm.waitText("ops", "PAUSED")
	c := acquire(tokA)
	tm.waitText("live", c)
	if s := tm.capture("ops"); strings.Contains(s, c) {
		t.Fatalf("the paused screen shows lease %s acquired after the pause:\n%s", c, s)
	}
	tm.keys("ops", "p")
	tm.waitText("ops", c, "live")

	// A client token sees its own tenant's leases only.
	screen = tm.waitText("team-b", b, "hosts 2/2 ready")
	if strings.Contains(screen, a) || strings.Contains(screen, c) || strings.Contains(screen, "team-a") {
		t.Fatalf("team-b's screen shows team-a's leases:\n%s", screen)
	}

	// Narrower than 80 columns: every line fits, the sections stay.
	for _, width := range []int{60, 40} {
		tm.run("resize-window", "-t", "ops", "-x", fmt.Sprint(width), "-y", "30")
		screen = tm.waitFor("ops", fmt.Sprintf("a %d-column screen", width), func(s string) bool {
			for _, l := range strings.Split(strings.TrimRight(s, "\n"), "\n") {
				if utf8.RuneCountInString(l) > width {
					return false
				}
			}
			return strings.Contains(s, "-- POOL") && strings.Contains(s, "-- HOSTS") && strings.Contains(s, "hosts 2/2")
		})
		for _, want := range []string{"A100-SXM4-80GB", "host-1", "QUEUE", "EVENTS"} {
			if !strings.Contains(screen, want) {
				t.Errorf("at %d columns the screen lacks %q:\n%s", width, want, screen)
			}
		}
	}

	// q quits with status 0.
	tm.keys("ops", "q")
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		b, err := os.ReadFile(exitFile)
		if err == nil && strings.HasSuffix(string(b), "\n") {
			if got := strings.TrimSpace(string(b)); got != "0" {
				t.Fatalf("top exited with status %s after q, want 0", got)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("top did not exit within 60s of q; the screen:\n%s", tm.capture("ops"))
		}
	}
}

func TestTopWithoutATerminalRefusesWithExitCode2(t *testing.T) {
	_, stderr, code := gpupool(t, "top", "--addr=127.0.0.1:1")
	if code != 2 || !strings.Contains(stderr, "top needs a terminal") {
		t.Fatalf("top without a terminal: exit %d, %q; want 2 and 'top needs a terminal'", code, stderr)
	}
}
