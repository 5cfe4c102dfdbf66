package main

import (
	"strings"
	"testing"
)

func TestPprofBindAcceptsOnlyLoopback(t *testing.T) {
	tests := []struct {
		addr    string
		wantErr string
	}{
		{addr: "127.0.0.1:6060"},
		{addr: "127.0.0.9:0"},
		{addr: "[::1]:6060"},
		{addr: "localhost:6060"},
		{addr: "0.0.0.0:6060", wantErr: "must be a loopback address"},
		{addr: "10.0.0.1:6060", wantErr: "must be a loopback address"},
		{addr: ":6060", wantErr: "must be a loopback address"},
		{addr: "127.0.0.1", wantErr: "give HOST:PORT on loopback"},
	}
	for _, tt := range tests {
		t.Run(tt.addr, func(t *testing.T) {
			err := loopbackAddr(tt.addr)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("got %v, want no error", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("got %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}
