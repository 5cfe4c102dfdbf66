package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestHealthzAndReadyzOnTheMetricsListener(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	var notReady atomic.Pointer[error]
	ready := func() error {
		if e := notReady.Load(); e != nil {
			return *e
		}
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := serveMetrics(ctx, addr, prometheus.NewRegistry(), ready, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	no := errors.New("no leader known")
	cases := []struct {
		name     string
		notReady error
		path     string
		code     int
		body     string
	}{
		{"healthz answers while up", nil, "/healthz", 200, "ok"},
		{"readyz answers ok when ready", nil, "/readyz", 200, "ok"},
		{"readyz says why when not ready", no, "/readyz", 503, "not ready: no leader known"},
		{"healthz does not depend on readiness", no, "/healthz", 200, "ok"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.notReady != nil {
				notReady.Store(&c.notReady)
			} else {
				notReady.Store(nil)
			}
			code, body := get(c.path)
			if code != c.code || !strings.Contains(body, c.body) {
				t.Errorf("GET %s: got %d %q, want %d %q", c.path, code, body, c.code, c.body)
			}
		})
	}
}
