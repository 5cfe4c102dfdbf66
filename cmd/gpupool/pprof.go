package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"runtime"
	"time"
)

// pprofMutexFraction is the share of contended mutex events a broker
// serving --pprof-bind records (1 in n): enough for a profile, cheap
// enough to leave on while a benchmark runs.
const pprofMutexFraction = 5

// servePprof serves Go's runtime profiles at http://addr/debug/pprof/
// until ctx ends, and turns on the mutex and block profiles they need.
// An empty addr serves nothing and records nothing. The profiles show the
// process's internals to anyone who reaches addr: bind it to loopback.
func servePprof(ctx context.Context, addr string, log *slog.Logger) error {
	if addr == "" {
		return nil
	}
	if err := loopbackAddr(addr); err != nil {
		return err
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("--pprof-bind %s: %w", addr, err)
	}
	runtime.SetMutexProfileFraction(pprofMutexFraction)
	runtime.SetBlockProfileRate(int(time.Millisecond)) // blocking of 1 ms or more
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	serveHTTP(ctx, lis, mux, log, "pprof")
	log.Info("serving profiles", "url", "http://"+lis.Addr().String()+"/debug/pprof/")
	return nil
}

// loopbackAddr refuses a --pprof-bind address that is not on loopback:
// the profiles have no TLS and no ACL.
func loopbackAddr(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return usagef("--pprof-bind %q: %v; give HOST:PORT on loopback, e.g. 127.0.0.1:6060", addr, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return usagef("--pprof-bind %q: must be a loopback address (127.0.0.0/8, ::1 or localhost), e.g. 127.0.0.1:6060: the profiles have no TLS and no ACL", addr)
	}
	return nil
}
