package main

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/pki"
)

func newBrokerCmd() *cobra.Command {
	var (
		cfg       broker.Config
		join      string
		logLevel  string
		raftLog   bool
		auditFile string
		metrics   string
		pprofBind string
		insecure  bool
		lim       = broker.DefaultLimits()
	)
	cmd := &cobra.Command{
		Use:   "broker --data-dir DIR --bind ADDR (--bootstrap-expect N | --join ADDR,...)",
		Short: "Run one broker server of a Raft-replicated cluster",
		Long: `Run one broker server. Three or five servers form a cluster: each one keeps
the Raft log (bbolt, fsync on) and snapshots in --data-dir, serves gRPC on
--bind and replicates on --raft-bind (default: --bind's port + 1).

A new cluster forms once --bootstrap-expect servers can reach each other
through --join. A server restarted on its data dir rejoins by itself, also on a
new --raft-bind/--bind address (it asks the leader, through --join, to update
its address; restart servers one at a time so a majority stays reachable); a
server with an empty data dir and only --join joins a running cluster.

Security. Every connection is mutual TLS: gRPC from clients, agents and the
other servers, and Raft between servers (only broker certificates). Give the
cluster CA and this server's certificate with --tls-ca, --tls-cert and
--tls-key (see 'gpupool operator tls --help'); the certificate must name the
addresses clients dial (--host when it is issued). The files are read again
when they change, so a rotated certificate is used without a restart. Without
them the broker refuses to start.

ACL is on (--acl): every call needs a token (--token on the CLI,
GPUPOOL_TOKEN), except the first 'gpupool operator acl bootstrap', which
creates the management token. A server joining a cluster whose ACL is
bootstrapped (a new server, or one restarted on a new address) sends --token
(GPUPOOL_TOKEN), a management token; forming a new cluster needs none.

--insecure turns both off: plaintext, and every caller may do everything. It
is for tests and benchmarks on a closed machine only. See docs/security.md.`,
		Example: `  # a 3-server cluster with TLS (certificates from 'gpupool operator tls issue --role broker')
  export GPUPOOL_TLS_CA=/etc/gpupool/ca.pem
  gpupool broker --data-dir /var/lib/gpupool/b1 --bind 10.0.0.1:7641 --bootstrap-expect 3 --join 10.0.0.2:7641,10.0.0.3:7641 \
    --tls-cert /etc/gpupool/broker-1.pem --tls-key /etc/gpupool/broker-1-key.pem
  # ... and the same on 10.0.0.2 and 10.0.0.3 with their own certificates; then the first token:
  gpupool operator acl bootstrap --addr 10.0.0.1:7641 --tls-cert /etc/gpupool/admin.pem --tls-key /etc/gpupool/admin-key.pem

  # a throw-away single server for an experiment or a benchmark: no TLS, no ACL
  gpupool broker --data-dir /tmp/gp --bind 127.0.0.1:7641 --bootstrap-expect 1 --insecure`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			logger, err := newLogger(logLevel)
			if err != nil {
				return err
			}
			cfg.Join = client.ParseAddrs(join)
			if cfg.DataDir == "" {
				return usagef("--data-dir is required: the directory that keeps this server's Raft log and snapshots")
			}
			if r := cfg.EndedLeaseRetention; r < broker.MinEndedLeaseRetention || r > broker.MaxEndedLeaseRetention {
				return usagef("--ended-lease-retention %s: must be between %s and %s", r, broker.MinEndedLeaseRetention, broker.MaxEndedLeaseRetention)
			}
			if n := cfg.EndedLeasesMax; n < 1 || n > broker.MaxEndedLeasesMax {
				return usagef("--ended-leases-max %d: must be between 1 and %d", n, broker.MaxEndedLeasesMax)
			}
			if pprofBind != "" {
				if err := loopbackAddr(pprofBind); err != nil {
					return err
				}
			}
			if cfg.BootstrapExpect == 0 && len(cfg.Join) == 0 {
				return usagef("give --bootstrap-expect N to form a new cluster of N servers, or --join ADDR,... to join a running one")
			}
			if cfg.TLS, err = global.tls.serverTLS("gpupool broker", pki.RoleBroker, insecure, logger, cmd.ErrOrStderr()); err != nil {
				return err
			}
			if err := aclMode(cmd, &cfg, insecure); err != nil {
				return err
			}
			if err := lim.Validate(); err != nil {
				return usagef("%v", err)
			}
			cfg.Limits = &lim
			if cfg.DiskReserveMiB < 0 {
				return usagef("--disk-reserve %d: must be 0 (no reserve) or more MiB", cfg.DiskReserveMiB)
			}
			if cfg.DiskReserveMiB == 0 {
				cfg.DiskReserveMiB = -1
			}
			if cfg.SlowDiskThreshold < 0 {
				return usagef("--slow-disk-threshold %s: must be 0 (never hand leadership over) or a duration such as 100ms", cfg.SlowDiskThreshold)
			}
			if cfg.SlowDiskThreshold == 0 {
				cfg.SlowDiskThreshold = -1
			}
			cfg.Token = globalToken()
			cfg.Logger = logger
			switch auditFile {
			case "":
			case "-":
				cfg.AuditSink = cmd.OutOrStdout()
			default:
				f, err := os.OpenFile(auditFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
				if err != nil {
					return usagef("--audit-file %v", err)
				}
				defer f.Close()
				cfg.AuditSink = f
			}
			if raftLog {
				cfg.RaftLogOutput = os.Stderr
			}
			s, err := broker.New(cfg)
			if err != nil {
				return err
			}
			if err := serveMetrics(cmd.Context(), metrics, s.Metrics(), s.Ready, logger); err != nil {
				s.Shutdown()
				return err
			}
			if err := servePprof(cmd.Context(), pprofBind, logger); err != nil {
				s.Shutdown()
				return err
			}
			// Who serves this data dir: 'gpupool dev' adopts a broker
			// restarted by hand on its data dir from it.
			pidFile := filepath.Join(cfg.DataDir, brokerPIDFile)
			if err := os.WriteFile(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o600); err == nil {
				defer os.Remove(pidFile)
			}
			security := "plaintext, ACL OFF (--insecure)"
			if cfg.TLS != nil {
				security = fmt.Sprintf("mutual TLS as %q (certificate valid until %s), ACL on", cfg.TLS.Identity().Name, cfg.TLS.NotAfter().Format(time.RFC3339))
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "broker %s serving gRPC on %s, raft on %s, data in %s, %s\n", s.ID(), s.Addr(), s.RaftAddr(), cfg.DataDir, security)
			if u := s.UIURL(); u != "" {
				fmt.Fprintf(cmd.ErrOrStderr(), "broker %s console at %s\n", s.ID(), u)
			}
			select {
			case <-cmd.Context().Done():
			case <-s.Done():
				// The broker stopped on its own: a part it cannot serve
				// without failed (it logged which).
				s.Shutdown()
				return fmt.Errorf("broker %s stopped: %w", s.ID(), s.Err())
			}
			logger.Info("shutting down", "id", s.ID())
			return s.Shutdown()
		},
	}
	f := cmd.Flags()
	f.StringVar(&auditFile, "audit-file", "", "also write every audit entry this broker applies to this file (appended), one JSON object per line, or to stdout with -; a restarted broker writes the entries it replays again ((index, seq) identifies one)")
	f.StringVar(&cfg.DataDir, "data-dir", "", "directory for the Raft log, snapshots and node id (created on first start)")
	f.StringVar(&cfg.BindAddr, "bind", "127.0.0.1:7641", "gRPC listen address")
	f.StringVar(&cfg.RaftBindAddr, "raft-bind", "", "Raft listen address (default: --bind's port + 1)")
	f.IntVar(&cfg.BootstrapExpect, "bootstrap-expect", 0, "form a new cluster once this many servers know each other")
	f.StringVar(&join, "join", "", "other servers' gRPC addresses, comma-separated")
	f.StringVar(&cfg.NodeID, "node-id", "", "server id (default: the one stored in --data-dir, or a new random one)")
	f.IntVar(&cfg.PlacementWindow, "placement-window", 0, "ignored, kept so that old command lines still start: every placement is the best of the whole pool, through the pool index")
	f.StringVar(&cfg.Policy, "policy", broker.Policies[0], "placement policy: "+strings.Join(broker.Policies, ", ")+" (fgd: fragmentation gradient descent over the mix of requests the leader sees; binpack: fullest GPU that fits; spread: emptiest)")
	f.DurationVar(&cfg.HeartbeatInterval, "heartbeat-interval", broker.DefaultHeartbeatInterval, "how often agents heartbeat")
	f.DurationVar(&cfg.HeartbeatTTL, "heartbeat-ttl", broker.DefaultHeartbeatTTL, "a host without heartbeats for this long goes down")
	f.DurationVar(&cfg.LockDelay, "lock-delay", broker.DefaultLockDelay, "how long a down host's leases keep their capacity before it is freed")
	f.DurationVar(&cfg.EndedLeaseRetention, "ended-lease-retention", broker.DefaultEndedLeaseRetention,
		fmt.Sprintf("how long an ended (released, expired, revoked) lease stays readable, and a retry of its request id returns it, before the leader removes it from the state (%s to %s; audit entries are kept)", broker.MinEndedLeaseRetention, broker.MaxEndedLeaseRetention))
	f.IntVar(&cfg.EndedLeasesMax, "ended-leases-max", broker.DefaultEndedLeasesMax,
		fmt.Sprintf("how many ended leases the state keeps at most; the oldest beyond it are removed before --ended-lease-retention passes (1 to %d)", broker.MaxEndedLeasesMax))
	f.DurationVar(&cfg.PreemptGrace, "preempt-grace", broker.DefaultPreemptGrace, "how long a preempted lease (or an elastic lease's extra taken back) keeps running after its notice")
	f.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.BoolVar(&raftLog, "raft-log", false, "also print raft's own warnings")
	f.StringVar(&metrics, "metrics-bind", "", "serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9641); empty serves none")
	f.StringVar(&pprofBind, "pprof-bind", "", "serve Go's CPU, mutex and block profiles at http://ADDR/debug/pprof/ (e.g. 127.0.0.1:6060; loopback only: no TLS, no ACL), for 'gpupool-bench lease --profile'; empty serves none")
	f.BoolVar(&cfg.ACL, "acl", true, "check an ACL token on every call; --acl=false trusts every certificate of the cluster CA (prints a warning), --insecure turns it off too")
	f.BoolVar(&insecure, "insecure", false, insecureUsage)
	f.StringVar(&cfg.UI.Bind, "ui-bind", "", "serve the read-only web console at ADDR (e.g. 127.0.0.1:7701; HTTPS when the broker has TLS; sign in with an ACL token); empty serves none")
	f.Float64Var(&lim.TokenRate.PerSecond, broker.FlagTokenRate, lim.TokenRate.PerSecond, "requests (calls and new streams) one ACL token may make per second on this broker; 0: no limit. Over it a call fails with RESOURCE_EXHAUSTED naming the limit")
	f.IntVar(&lim.TokenRate.Burst, broker.FlagTokenBurst, lim.TokenRate.Burst, "how many requests over --"+broker.FlagTokenRate+" one token may make in a burst (at least 1)")
	f.IntVar(&lim.TokenStreams, broker.FlagTokenStreams, lim.TokenStreams, "streams (watch, keep-alive, heartbeat) one ACL token may hold open at once on this broker; 0: no limit")
	f.Float64Var(&lim.ClientConnRate.PerSecond, broker.FlagClientConnRate, lim.ClientConnRate.PerSecond, "new connections one client address may open per second; the calls of a connection over it fail with RESOURCE_EXHAUSTED; 0: no limit")
	f.IntVar(&lim.ClientConnRate.Burst, broker.FlagClientConnBurst, lim.ClientConnRate.Burst, "how many new connections over --"+broker.FlagClientConnRate+" one client address may open in a burst (at least 1)")
	f.IntVar(&lim.TenantPending, broker.FlagTenantPending, lim.TenantPending, "acquires with a wait that one tenant may have in progress at once on the leader (the queue's pending requests); 0: no limit")
	f.IntVar(&lim.Writes.Seats, broker.FlagWriteSeats, lim.Writes.Seats, "writes (acquire, release, admin changes) of ACL tokens the leader has in flight at once, shared fairly between tokens: a seat that frees goes to the waiting token holding the fewest; 0: no limit")
	f.IntVar(&lim.Writes.Share, broker.FlagTokenWrites, lim.Writes.Share, "writes one ACL token may have in flight at once on the leader (at most --"+broker.FlagWriteSeats+"); more wait in its queue; 0: no limit")
	f.IntVar(&lim.Writes.Queue, broker.FlagTokenWriteQueue, lim.Writes.Queue, "writes of one ACL token that may wait for a seat; more fail with RESOURCE_EXHAUSTED; 0: none wait (refused at once when no seat is free)")
	f.IntVar(&cfg.DiskReserveMiB, "disk-reserve", broker.DefaultDiskReserveMiB, "MiB that must stay free on --data-dir's file system: below it the Raft log refuses writes (calls fail UNAVAILABLE saying the disk is full) until space returns, and the broker resumes by itself; 0: no reserve")
	f.DurationVar(&cfg.SlowDiskThreshold, "slow-disk-threshold", broker.DefaultSlowDiskThreshold, "a leader whose Raft log writes (fsync) take longer than this (median of the last 5s) hands leadership to a follower, at most once in 30s; 0: never")
	f.IntVar(&cfg.UI.StreamsPerToken, "ui-streams-per-token", 0, "live console streams one token may hold open at once (default 8)")
	return cmd
}

// brokerPIDFile, in a broker's data dir, holds the pid of the broker
// serving it while it runs.
const brokerPIDFile = "broker.pid"

// aclMode applies --acl and --insecure. ACL is on unless --insecure turns
// it off with TLS, or --acl=false turns it off on a TLS cluster, where
// the certificate then is the only proof a caller needs.
func aclMode(cmd *cobra.Command, cfg *broker.Config, insecure bool) error {
	switch {
	case insecure && cmd.Flags().Changed("acl") && cfg.ACL:
		return usagef("--acl with --insecure: --insecure turns ACL off; give one or the other")
	case insecure:
		cfg.ACL = false // serverTLS printed the warning
	case !cfg.ACL:
		fmt.Fprintln(cmd.ErrOrStderr(), "WARNING: --acl=false: no ACL tokens. Every holder of a certificate from the cluster CA may "+
			"acquire, release and watch any tenant's leases, drain hosts and restore snapshots.")
	}
	return nil
}

// noArgs rejects positional arguments with a usage error.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments, got %q (flags start with --)", cmd.CommandPath(), strings.Join(args, " "))
	}
	return nil
}

// newLogger returns a text logger on stderr at the named level.
func newLogger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, usagef("--log-level %q: must be debug, info, warn or error", level)
	}
	h := slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{
		Level: l,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.String(slog.TimeKey, a.Value.Time().Format(time.TimeOnly+".000"))
			}
			return a
		},
	})
	return slog.New(h), nil
}
