package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

func newQuotaCmd() *cobra.Command {
	return newGroupCmd(&cobra.Command{
		Use:   "quota",
		Short: "Limit the GPUs, memory and compute each tenant may hold",
		Long: `A quota caps what a tenant's leases hold at once, in up to three dimensions:
  GPUs     GPUs' worth, summed over slices and rounded up: a slice counts
           1 when exclusive or when it takes 100% compute or all of the
           GPU's memory, else the larger of compute/100 and its memory
           over the GPU's (20% and 40 of 80 GiB is 0.5); so two 50% slices
           count 1 GPU, and three count 2
  memory   GPU memory: a fractional slice its own, an exclusive one the GPU's
  compute  percent of one GPU, summed: 800 is eight GPUs' worth; an
           exclusive slice counts 100
0 in a dimension is unlimited, and a tenant without a quota is unlimited;
a quota needs at least one limit above 0.
Granted leases count, and so do ending ones until their capacity is freed.

The brokers check the quota in the same Raft entry that grants a lease, so
concurrent acquires never exceed it. An acquire past the quota fails with
the tenant, the dimension, what is used and what the lease needs.`,
		Example: `  gpupool operator quota set sim --gpus 8 --memory 320GiB --compute 800
  gpupool operator quota ls
  gpupool operator quota rm sim`,
	},
		newQuotaSetCmd(),
		newQuotaListCmd(),
		newQuotaRemoveCmd(),
	)
}

type quotaFlags struct {
	gpus    int32
	memory  string
	compute string
}

// quota reads the flags into a quota for tenant. Every dimension not
// given is unlimited (0).
func (f *quotaFlags) quota(cmd *cobra.Command, tenant string) (*gpupoolv1.Quota, error) {
	if err := protocol.ValidateTenant("TENANT", tenant); err != nil {
		return nil, usagef("%v", err)
	}
	fs := cmd.Flags()
	if !fs.Changed("gpus") && !fs.Changed("memory") && !fs.Changed("compute") {
		return nil, usagef("say what to limit: --gpus, --memory and/or --compute (e.g. --gpus 8 --memory 320GiB --compute 800); to lift every limit use 'gpupool operator quota rm %s'", tenant)
	}
	q := &gpupoolv1.Quota{Tenant: tenant, Gpus: f.gpus}
	if f.gpus < 0 {
		return nil, usagef("--gpus %d: must be 0 (unlimited) or more", f.gpus)
	}
	if fs.Changed("memory") {
		n, err := parseMemoryFlag("memory", f.memory, 0)
		if err != nil {
			return nil, err
		}
		q.MemoryMib = n
	}
	if fs.Changed("compute") {
		n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(f.compute), "%"), 10, 64)
		if err != nil || n < 0 {
			return nil, usagef("--compute %q: must be a whole percent, 0 (unlimited) or more, summed over GPUs: 800 is eight GPUs' worth", f.compute)
		}
		q.ComputePercent = n
	}
	if q.Gpus == 0 && q.MemoryMib == 0 && q.ComputePercent == 0 {
		return nil, usagef("a quota of 0 in every dimension limits nothing (0 is unlimited): give --gpus, --memory or --compute above 0; to lift every limit use 'gpupool operator quota rm %s'", tenant)
	}
	return q, nil
}

func newQuotaSetCmd() *cobra.Command {
	var f quotaFlags
	cmd := &cobra.Command{
		Use:   "set TENANT [--gpus N] [--memory SIZE] [--compute PERCENT]",
		Short: "Set a tenant's quota, replacing the one it had",
		Long: `Set gives TENANT a quota. It replaces the whole quota: a dimension not given
is unlimited, and at least one must be above 0 (to lift every limit, use
'gpupool operator quota rm TENANT'). A quota below what the tenant holds now is set all the same,
with a warning saying what is over: running leases keep their capacity, and
new grants are refused until usage is under the quota.`,
		Example: `  # At most 8 whole GPUs, 320 GiB of GPU memory and 8 GPUs' worth of compute
  gpupool operator quota set sim --gpus 8 --memory 320GiB --compute 800

  # Only memory is limited
  gpupool operator quota set notebooks --memory 64GiB`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			q, err := f.quota(cmd, args[0])
			if err != nil {
				return err
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.SetQuota(ctx, &gpupoolv1.SetQuotaRequest{Quota: q})
				if err != nil {
					return err
				}
				for _, w := range resp.GetWarnings() {
					fmt.Fprintf(cmd.ErrOrStderr(), "warning: %s\n", w)
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					return printQuotas(w, []*gpupoolv1.QuotaStatus{resp.GetQuota()})
				})
			})
		},
	}
	fs := cmd.Flags()
	fs.Int32Var(&f.gpus, "gpus", 0, "GPUs' worth the tenant may hold: an exclusive or whole-device slice counts 1, a fractional one its larger share of compute or memory, summed and rounded up; 0 is unlimited")
	fs.StringVar(&f.memory, "memory", "", "GPU memory the tenant may hold, e.g. 320GiB (a plain number is MiB); 0 is unlimited")
	fs.StringVar(&f.compute, "compute", "", "compute in percent of one GPU, summed over slices: 800 is eight GPUs' worth; 0 is unlimited")
	return cmd
}

func newQuotaListCmd() *cobra.Command {
	var stale bool
	cmd := &cobra.Command{
		Use:     "ls [TENANT]",
		Aliases: []string{"list"},
		Short:   "List the quotas with each tenant's usage against them",
		Long: `Ls shows, for every tenant with a quota, what its leases hold against it as
used/quota. "-" is unlimited; "(over)" marks a dimension above its quota,
after the quota was lowered below what the tenant held.`,
		Example: `  gpupool operator quota ls
  gpupool operator quota ls sim -o json`,
		Args: usageArgs(cobra.MaximumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &gpupoolv1.ListQuotasRequest{Stale: stale}
			if len(args) == 1 {
				if err := protocol.ValidateTenant("TENANT", args[0]); err != nil {
					return usagef("%v", err)
				}
				req.Tenant = args[0]
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.ListQuotas(ctx, req)
				if err != nil {
					return err
				}
				ids := idsOf(resp.GetQuotas(), func(q *gpupoolv1.QuotaStatus) string { return q.GetQuota().GetTenant() })
				return renderList(cmd.OutOrStdout(), resp, "", ids, func(w io.Writer) error {
					if len(resp.GetQuotas()) == 0 {
						_, err := fmt.Fprintln(w, "no quotas: every tenant is unlimited; set one with 'gpupool operator quota set TENANT --gpus 8'")
						return err
					}
					return printQuotas(w, resp.GetQuotas())
				})
			})
		},
	}
	addStaleFlag(cmd, &stale)
	return cmd
}

func newQuotaRemoveCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "rm TENANT",
		Aliases: []string{"remove"},
		Short:   "Remove a tenant's quota: the tenant is unlimited again",
		Long:    `Rm drops TENANT's quota. Its leases are not touched; new grants are no longer limited.`,
		Example: `  gpupool operator quota rm sim`,
		Args:    exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := protocol.ValidateTenant("TENANT", args[0]); err != nil {
				return usagef("%v", err)
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.RemoveQuota(ctx, &gpupoolv1.RemoveQuotaRequest{Tenant: args[0]})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					_, err := fmt.Fprintf(w, "removed the quota of tenant %s; it is unlimited now\n", args[0])
					return err
				})
			})
		},
	}
}

// printQuotas prints one row per tenant: used/quota in each dimension.
func printQuotas(w io.Writer, quotas []*gpupoolv1.QuotaStatus) error {
	t := newTable(w, "TENANT", "GPUS", "MEMORY", "COMPUTE", "LEASES")
	pct := func(n int64) string { return strconv.FormatInt(n, 10) + "%" }
	num := func(n int64) string { return strconv.FormatInt(n, 10) }
	for _, s := range quotas {
		q, u := s.GetQuota(), s.GetUsage()
		t.row(q.GetTenant(),
			usedOf(int64(u.GetGpus()), int64(q.GetGpus()), num),
			usedOf(u.GetMemoryMib(), q.GetMemoryMib(), compactMiB),
			usedOf(u.GetComputePercent(), q.GetComputePercent(), pct),
			u.GetLeases())
	}
	return t.flush()
}

// usedOf is a quota cell: "3/8", "3/-" when unlimited, "9/8 (over)".
func usedOf(used, quota int64, format func(int64) string) string {
	if quota == 0 {
		return format(used) + "/-"
	}
	s := format(used) + "/" + format(quota)
	if used > quota {
		s += " (over)"
	}
	return s
}
