package main

import (
	"os"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/cmd/gpupool/internal/top"
)

func newTopCmd() *cobra.Command {
	var (
		interval time.Duration
		sortKey  string
		opts     top.Options
	)
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Live terminal dashboard of the pool: use by model, busiest hosts, queue, drains, events",
		Long: `Top shows the pool live, compact enough for an ssh session:

  POOL    per GPU model, compute and memory reserved by leases against the
          utilisation and memory the agents measure
  HOSTS   the busiest hosts first (sort key 's')
  QUEUE   pending leases in the order they are served, with why they wait
  DRAINS  hosts draining: leases left, time to the deadline, reason
  EVENTS  lease grants, ends, violations and notices, drains, quotas

It follows the lease watch and the audit log, and polls hosts, the status and
the queue every --interval. It shows only what the token may see: a client
token sees its tenants' leases and events and the pool's capacity.

Keys: s sort hosts (util, reserved, memory, leases, name); t next tenant,
T all tenants; m next GPU model, M all models; a clear filters; p or space
pause (the screen stays, updates wait) and resume; q quit.

Top needs a terminal; in scripts use 'gpupool status', 'gpupool host ls' or
'gpupool lease ls', each with -o json.`,
		Example: `  gpupool top
  gpupool top --tenant ml --model 'A100-SXM4-80GB'
  gpupool top --sort reserved --interval 5s`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if global.output != "table" {
				return usagef("--output %q: top draws a screen; for JSON use 'gpupool status -o json' or 'gpupool lease ls -o json'", global.output)
			}
			if interval < 500*time.Millisecond || interval > time.Hour {
				return usagef("--interval %s: must be between 500ms and 1h", interval)
			}
			k, err := top.ParseSortKey(sortKey)
			if err != nil {
				return usagef("--%s", err)
			}
			opts.Sort = k
			if !isatty.IsTerminal(os.Stdin.Fd()) || !isatty.IsTerminal(os.Stdout.Fd()) {
				return usagef("top needs a terminal on stdin and stdout; in scripts use 'gpupool status', 'gpupool host ls' or 'gpupool lease ls' (with -o json)")
			}
			c, err := dial()
			if err != nil {
				return err
			}
			defer c.Close()
			src := &top.GRPCSource{Clients: top.Clients{Lease: c.Lease, Pool: c.Pool, Operator: c.Operator},
				Interval: interval, Timeout: global.timeout, AuditBacklog: 50}
			return top.Run(cmd.Context(), src, opts, os.Stdin, os.Stdout)
		},
	}
	f := cmd.Flags()
	f.DurationVar(&interval, "interval", 2*time.Second, "how often to poll hosts, the status and the queue")
	f.StringVar(&sortKey, "sort", "util", "host order at start: util, reserved, memory, leases or name")
	f.StringVar(&opts.Tenant, "tenant", "", "show only this tenant's leases, queue and events at start")
	f.StringVar(&opts.Model, "model", "", "show only this GPU model at start")
	return cmd
}
