package main

import (
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpupool/gpupool/internal/pki"
)

// tlsInitAndIssue makes a CA and certificates with the CLI itself.
func tlsInitAndIssue(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "ca")
	for _, args := range [][]string{
		{"operator", "tls", "init", "--dir", dir},
		{"operator", "tls", "issue", "--ca-dir", dir, "--name", "broker-1", "--role", "broker", "--host", "127.0.0.1,broker-1.example"},
		{"operator", "tls", "issue", "--ca-dir", dir, "--name", "gpu-7", "--role", "agent", "--host-id", "gpu-7"},
		{"operator", "tls", "issue", "--ca-dir", dir, "--name", "alice", "--role", "client", "--days", "30"},
	} {
		if code, _, stderr := runOffline(t, args...); code != 0 {
			t.Fatalf("gpupool %s: exit %d: %s", strings.Join(args, " "), code, stderr)
		}
	}
	return dir
}

func TestTLSIssueWritesCertificatesWithTheirRole(t *testing.T) {
	dir := tlsInitAndIssue(t)
	for _, tc := range []struct {
		name string
		want pki.Identity
	}{
		{"broker-1", pki.Identity{Name: "broker-1", Role: pki.RoleBroker}},
		{"gpu-7", pki.Identity{Name: "gpu-7", Role: pki.RoleAgent, HostID: "gpu-7"}},
		{"alice", pki.Identity{Name: "alice", Role: pki.RoleClient}},
	} {
		certPath, keyPath := pki.KeyPairPaths(dir, tc.name)
		b, err := os.ReadFile(certPath)
		if err != nil {
			t.Fatal(err)
		}
		blk, _ := pem.Decode(b)
		cert, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		if id, err := pki.IdentityOf(cert); err != nil || id != tc.want {
			t.Errorf("%s: identity %+v (%v), want %+v", tc.name, id, err, tc.want)
		}
		fi, err := os.Stat(keyPath)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: key mode %v, want 0600", tc.name, fi.Mode().Perm())
		}
	}
}

func TestTLSCommandsRefuseBadInput(t *testing.T) {
	dir := tlsInitAndIssue(t)
	issue := func(extra ...string) []string {
		return append([]string{"operator", "tls", "issue", "--ca-dir", dir, "--name", "x"}, extra...)
	}
	checkUsageErrors(t, []usageCase{
		{"init without a directory", []string{"operator", "tls", "init"}, []string{"--dir is required"}},
		{"init over an existing CA", []string{"operator", "tls", "init", "--dir", dir}, []string{"--dir " + dir, "a CA already exists"}},
		{"init with an unknown algorithm", []string{"operator", "tls", "init", "--dir", t.TempDir(), "--algorithm", "rsa"}, []string{`--algorithm "rsa"`, "ecdsa-p256, ed25519"}},
		{"init with zero days", []string{"operator", "tls", "init", "--dir", t.TempDir(), "--days", "0"}, []string{"--days 0"}},
		{"issue with an unknown role", issue("--role", "admin"), []string{`--role "admin"`, "broker, agent, client"}},
		{"issue without a role", issue(), []string{`--role ""`, "broker, agent, client"}},
		{"issue from a directory without a CA", []string{"operator", "tls", "issue", "--ca-dir", t.TempDir(), "--name", "x", "--role", "client"}, []string{"--ca-dir", "no CA", "tls init"}},
		{"issue without --ca-dir", []string{"operator", "tls", "issue", "--name", "x", "--role", "client"}, []string{"--ca-dir is required"}},
		{"issue without --name", []string{"operator", "tls", "issue", "--ca-dir", dir, "--role", "client"}, []string{"--name is required"}},
		{"issue with a name that is no file name", []string{"operator", "tls", "issue", "--ca-dir", dir, "--name", "../x", "--role", "client"}, []string{`--name "../x"`}},
		{"issue with zero days", issue("--role", "client", "--days", "0"), []string{"--days 0", "1 or more"}},
		{"issue with negative days", issue("--role", "client", "--days", "-3"), []string{"--days -3"}},
		{"issue beyond the CA's life", issue("--role", "client", "--days", "100000"), []string{"--days 100000", "outlive the CA"}},
		{"issue a broker without an address", issue("--role", "broker"), []string{"--host", "a broker certificate needs"}},
		{"issue a client with an address", issue("--role", "client", "--host", "10.0.0.1"), []string{"--host", "only broker certificates"}},
		{"issue a bad address", issue("--role", "broker", "--host", "a b"), []string{`--host "a b"`, "IP address or a DNS name"}},
		{"issue a client bound to a host", issue("--role", "client", "--host-id", "h1"), []string{"--host-id", "only agent certificates"}},
	})
}

func TestBrokerAndAgentRefuseToStartWithoutTLS(t *testing.T) {
	dir := tlsInitAndIssue(t)
	ca := filepath.Join(dir, pki.CACertFile)
	cert := func(name string) []string {
		c, k := pki.KeyPairPaths(dir, name)
		return []string{"--tls-ca", ca, "--tls-cert", c, "--tls-key", k}
	}
	broker := []string{"broker", "--data-dir", t.TempDir(), "--bind", "127.0.0.1:0", "--raft-bind", "127.0.0.1:0", "--bootstrap-expect", "1"}
	agent := []string{"agent", "--broker", "127.0.0.1:1", "--simulate", "1xA100-80GB", "--data-dir", t.TempDir()}
	with := func(base []string, extra ...string) []string { return append(append([]string{}, base...), extra...) }
	checkUsageErrors(t, []usageCase{
		{"a broker without TLS files or --insecure", broker, []string{"gpupool broker needs TLS", "--tls-ca", "--tls-cert", "--tls-key", "--insecure", "GPUPOOL_TLS_CA"}},
		{"an agent without TLS files or --insecure", agent, []string{"gpupool agent needs TLS", "--tls-ca", "--insecure", "--role agent"}},
		{"a broker with TLS files and --insecure", with(broker, append(cert("broker-1"), "--insecure")...), []string{"--insecure and --tls-ca", "contradict"}},
		{"a broker with half the TLS flags", with(broker, "--tls-ca", ca), []string{"--tls-cert is missing"}},
		{"a broker with a client certificate", with(broker, cert("alice")...), []string{"client certificate", "--role broker"}},
		{"an agent with a broker certificate", with(agent, cert("broker-1")...), []string{"broker certificate", "--role agent"}},
		{"an agent posing as another host", with(agent, append(cert("gpu-7"), "--host-id", "gpu-8")...), []string{`--host-id "gpu-8"`, `bound to host "gpu-7"`}},
		{"a broker with a missing CA file", with(broker, "--tls-ca", filepath.Join(dir, "none.pem"), "--tls-cert", ca, "--tls-key", ca), []string{"--tls-ca", "none.pem"}},
		{"a client with a certificate of another CA", append([]string{"status", "--tls-ca", filepath.Join(tlsInitAndIssue(t), pki.CACertFile)}, cert("alice")[2:]...), []string{"--tls-cert", "certificate signed by unknown authority"}},
		{"dev with TLS flags", with([]string{"dev"}, cert("alice")...), []string{"--tls-ca", "gpupool dev runs without TLS"}},
	})
}

func TestInsecureWarnsOnceExceptUnderDev(t *testing.T) {
	for _, tc := range []struct {
		name     string
		dev      bool
		warnings int
	}{
		{"a broker started by hand warns", false, 1},
		{"a broker started by gpupool dev leaves it to dev's banner", true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.dev {
				t.Setenv(devChildEnv, "1")
			}
			var stderr strings.Builder
			src, err := tlsOpts{}.serverTLS("gpupool broker", pki.RoleBroker, true, nil, &stderr)
			if err != nil || src != nil {
				t.Fatalf("got %v, %v; want no source and no error", src, err)
			}
			if n := strings.Count(stderr.String(), "WARNING"); n != tc.warnings {
				t.Errorf("stderr %q has %d warnings, want %d", stderr.String(), n, tc.warnings)
			}
		})
	}
}
