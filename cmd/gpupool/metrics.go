package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// serveMetrics serves reg at http://addr/metrics until ctx ends, with
// /healthz (200 while the process serves HTTP) and /readyz (200 while
// ready returns nil, else 503 and the reason; nil ready is always ready).
// An empty addr serves nothing.
func serveMetrics(ctx context.Context, addr string, reg *prometheus.Registry, ready func() error, log *slog.Logger) error {
	return serveMetricsWith(ctx, addr, reg, ready, log, nil)
}

// serveMetricsWith is serveMetrics over TLS when tc is set (https, and
// whatever client certificates tc requires).
func serveMetricsWith(ctx context.Context, addr string, reg *prometheus.Registry, ready func() error, log *slog.Logger, tc *tls.Config) error {
	if addr == "" {
		return nil
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("--metrics-bind %s: %w", addr, err)
	}
	scheme := "http"
	if tc != nil {
		lis, scheme = tls.NewListener(lis, tc), "https"
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if ready != nil {
			if err := ready(); err != nil {
				http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	serveHTTP(ctx, lis, mux, log, "metrics")
	log.Info("serving metrics", "url", scheme+"://"+lis.Addr().String()+"/metrics")
	return nil
}

// serveHTTP serves h on lis until ctx ends, in the background. A failure
// to serve is logged as the name server's.
func serveHTTP(ctx context.Context, lis net.Listener, h http.Handler, log *slog.Logger, name string) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	go func() {
		if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error(name+" server stopped", "err", err)
		}
	}()
}
