package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// stdoutIsTerminal reports whether w is an interactive terminal, where the
// drain monitor redraws its line. Tests replace it.
var stdoutIsTerminal = func(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && (isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd()))
}

// drainOpts are the flags of 'host drain'.
type drainOpts struct {
	deadline             time.Duration
	noDeadline, force    bool
	monitor, detach, yes bool
	cancel               bool
	reason, selector     string
	deadlineSet          bool // --deadline given explicitly
}

// check validates the flag combination before anything is sent.
func (o *drainOpts) check(args []string) error {
	switch {
	case o.selector != "" && len(args) > 0:
		return usagef("HOST_ID %q and --selector %q: give one or the other", args[0], o.selector)
	case o.selector == "" && len(args) != 1:
		return usagef("accepts 1 arg(s), received %d; usage: gpupool host drain HOST_ID [flags], or gpupool host drain --selector key=value [flags]", len(args))
	case o.monitor && o.detach:
		return usagef("--monitor and --detach: give one or the other (--monitor is the default on a terminal)")
	case o.cancel && (o.force || o.noDeadline || o.deadlineSet):
		return usagef("--cancel ends the drain: it takes no --force, --deadline or --no-deadline")
	case o.cancel && o.monitor:
		return usagef("--cancel ends the drain at once: there is nothing to --monitor")
	case o.force && o.deadlineSet:
		return usagef("--force revokes every lease now and --deadline %s gives them time: give one or the other", o.deadline)
	case o.force && o.noDeadline:
		return usagef("--force revokes every lease now and --no-deadline never does: give one or the other")
	case o.noDeadline && o.deadlineSet:
		return usagef("--deadline %s and --no-deadline: give one or the other", o.deadline)
	case o.deadlineSet && o.deadline <= 0:
		return usagef("--deadline %s: must be positive; use --force to revoke the leases now, or --no-deadline to wait for them to end", o.deadline)
	case o.deadlineSet && o.deadline < protocol.MinDrainDeadline:
		return usagef("--deadline %s: must be at least %s; use --force to revoke the leases now", o.deadline, protocol.MinDrainDeadline)
	case o.deadline > protocol.MaxDrainDeadline:
		return usagef("--deadline %s: must be at most %s", o.deadline, protocol.MaxDrainDeadline)
	case len(o.reason) > protocol.MaxDrainReasonLen:
		return usagef("--reason: %d bytes, must be at most %d", len(o.reason), protocol.MaxDrainReasonLen)
	}
	if o.selector != "" {
		if _, err := parseSelector(o.selector); err != nil {
			return err
		}
	}
	return nil
}

// request is the drain request for one host. Without --deadline,
// --no-deadline or --force it keeps the deadline of a drain under way (a
// new --reason only); the default deadline is for a drain it starts.
func (o *drainOpts) request(host string) *gpupoolv1.DrainHostRequest {
	req := &gpupoolv1.DrainHostRequest{HostId: host, Cancel: o.cancel, Reason: o.reason, Force: o.force}
	if !o.cancel && !o.force && !o.noDeadline {
		req.DeadlineAfterMs = o.deadline.Milliseconds()
		req.KeepDeadline = !o.deadlineSet
	}
	return req
}

// changesDrain reports whether the flags ask for more than watching a
// drain already under way: a deadline, force or a reason.
func (o *drainOpts) changesDrain() bool {
	return o.cancel || o.force || o.noDeadline || o.deadlineSet || o.reason != ""
}

// parseSelector reads "k=v[,k=v]".
func parseSelector(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, usagef("--selector %q: must be key=value[,key=value], e.g. zone=eu-1", s)
		}
		out[k] = v
	}
	return out, nil
}

// drainTargets are the hosts a drain command names.
type drainTargets struct {
	hosts []*gpupoolv1.Host
	// prefix is set when HOST_ID named no host exactly but is a prefix of
	// one or more: the operator must confirm (gpu-1 is not gpu-10).
	prefix string
}

// several reports whether the command names hosts as a group (a selector
// or a prefix), where hosts it does not apply to are skipped.
func (t drainTargets) several(selector string) bool {
	return selector != "" || t.prefix != ""
}

// resolveDrainTargets picks the hosts named by id (exactly, else as a
// prefix) or by selector. A name or selector matching nothing is an error.
func resolveDrainTargets(all []*gpupoolv1.Host, id, selector string) (drainTargets, error) {
	var t drainTargets
	if selector != "" {
		sel, err := parseSelector(selector)
		if err != nil {
			return t, err
		}
		for _, h := range all {
			if labelsMatch(h.GetLabels(), sel) {
				t.hosts = append(t.hosts, h)
			}
		}
		if len(t.hosts) == 0 {
			return t, fmt.Errorf("--selector %q: matches no host; see the LABELS of 'gpupool host get HOST_ID'", selector)
		}
		return t, nil
	}
	for _, h := range all {
		if h.GetId() == id {
			t.hosts = []*gpupoolv1.Host{h}
			return t, nil
		}
		if strings.HasPrefix(h.GetId(), id) {
			t.hosts = append(t.hosts, h)
		}
	}
	if len(t.hosts) == 0 {
		return t, fmt.Errorf("host %q: not found; see 'gpupool host ls'", id)
	}
	t.prefix = id
	return t, nil
}

func labelsMatch(labels, sel map[string]string) bool {
	for k, v := range sel {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func hostIDs(hosts []*gpupoolv1.Host) []string {
	ids := make([]string, len(hosts))
	for i, h := range hosts {
		ids[i] = h.GetId()
	}
	sort.Strings(ids)
	return ids
}

func newHostDrainCmd() *cobra.Command {
	var o drainOpts
	cmd := &cobra.Command{
		Use:   "drain HOST_ID [--deadline 1h | --force | --no-deadline] [--monitor | --detach] [--yes]",
		Short: "Move the leases off a host, then keep it out of the pool",
		Long: `Drain makes a host ineligible at once, so no new lease lands on it, and the
Kubernetes driver taints its devices NoExecute so that pods using them are
evicted. Preemptible leases on the host are revoked at once; the holders of
the others get a drain notice with the deadline (on their KeepAlive stream and
the SDK's Events()) and their leases are revoked when it passes. The deadline
is kept by the brokers and survives a leader failover.

  --deadline D    revoke what is left after D (default 1h, at most 720h)
  --no-deadline   never revoke: wait for the leases to end by themselves
  --force         revoke every lease now

The host is drained once its last lease is freed, and stays out of the pool
until 'gpupool host eligibility HOST_ID --enable'. --cancel ends the drain at
once: the host is ready and eligible again (revoked leases stay revoked).
Draining a draining host with --deadline, --no-deadline or --force replaces
its deadline; --reason alone keeps it; with none of these it only monitors
the drain under way. --cancel of a host that is not draining fails (with
--selector such hosts are skipped).

--monitor, the default on a terminal, shows the leases left and the time to
the deadline until the host is drained, redrawn every second. Ctrl-C detaches:
the drain goes on. --detach returns at once (the default when stdout is not a
terminal, e.g. in scripts). With -o json the final host is printed.

HOST_ID may be a prefix of host names; when it is not exactly a host's name,
drain asks for confirmation naming the hosts it matched (even one: gpu-1 is
not gpu-10), and fails under --yes or without a terminal: name the host
exactly, or the hosts by label with --selector key=value[,key=value].`,
		Example: `  gpupool host drain gpu-node-3 --reason "kernel upgrade"
  gpupool host drain gpu-node-3 --deadline 15m --detach
  gpupool host drain gpu-node-3 --force
  gpupool host drain --selector rack=r2 --no-deadline
  gpupool host drain gpu-node-3 --cancel`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			f := cmd.Flags()
			o.deadlineSet = f.Changed("deadline")
			if err := o.check(args); err != nil {
				return err
			}
			if err := checkOutput(); err != nil {
				return err
			}
			id := ""
			if len(args) == 1 {
				id = args[0]
			}
			return runDrain(cmd, &o, id)
		},
	}
	f := cmd.Flags()
	f.DurationVar(&o.deadline, "deadline", protocol.DefaultDrainDeadline, "revoke the leases still on the host after this long")
	f.BoolVar(&o.noDeadline, "no-deadline", false, "never revoke: wait for the leases to end by themselves")
	f.BoolVar(&o.force, "force", false, "revoke every lease on the host now")
	f.BoolVar(&o.monitor, "monitor", false, "show progress until the host is drained (default on a terminal)")
	f.BoolVar(&o.detach, "detach", false, "return once the drain has started")
	f.BoolVar(&o.yes, "yes", false, "do not ask for confirmation (a HOST_ID that is only a prefix of host names still fails)")
	f.BoolVar(&o.cancel, "cancel", false, "end the drain: the host is ready and eligible again")
	f.StringVar(&o.reason, "reason", "", "why, shown as the host's status reason and in drain notices")
	f.StringVar(&o.selector, "selector", "", "drain every host with these labels, key=value[,key=value]")
	return cmd
}

func runDrain(cmd *cobra.Command, o *drainOpts, id string) error {
	c, err := dial()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx := cmd.Context()
	call := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, global.timeout) }

	cctx, cancel := call()
	list, err := c.Pool.ListHosts(cctx, &gpupoolv1.ListHostsRequest{})
	cancel()
	if err != nil {
		return err
	}
	t, err := resolveDrainTargets(list.GetHosts(), id, o.selector)
	if err != nil {
		return err
	}
	if t.prefix != "" {
		if err := confirmPrefix(cmd, o, t); err != nil {
			return err
		}
	}
	out := cmd.OutOrStdout()
	var final []*gpupoolv1.DrainHostResponse
	for _, h := range t.hosts {
		if h.GetDrain() != nil && !o.changesDrain() {
			// Already draining and nothing to change: just watch it.
			final = append(final, &gpupoolv1.DrainHostResponse{Host: h})
			continue
		}
		if o.cancel && h.GetDrain() == nil && t.several(o.selector) {
			fmt.Fprintf(cmd.ErrOrStderr(), "host %s: not draining; skipped\n", h.GetId())
			continue
		}
		cctx, cancel := call()
		resp, err := c.Pool.DrainHost(cctx, o.request(h.GetId()))
		cancel()
		if o.cancel && status.Code(err) == codes.FailedPrecondition && t.several(o.selector) {
			// Its drain ended since the list was read.
			fmt.Fprintf(cmd.ErrOrStderr(), "host %s: %s; skipped\n", h.GetId(), status.Convert(err).Message())
			continue
		}
		if err != nil {
			return fmt.Errorf("host %s: %w", h.GetId(), err)
		}
		final = append(final, resp)
		if global.output != "json" {
			printDrainStarted(out, resp, time.Now())
		}
	}
	monitor := o.monitor || (!o.detach && !o.cancel && stdoutIsTerminal(out))
	if monitor {
		w := out
		if global.output == "json" {
			w = cmd.ErrOrStderr()
		}
		hosts, err := monitorDrain(ctx, c, w, hostIDs(t.hosts), stdoutIsTerminal(w))
		if errors.Is(err, errDetached) {
			fmt.Fprintln(cmd.ErrOrStderr(), "\ndetached: the drain goes on. Cancel it with:")
			if o.selector != "" {
				fmt.Fprintf(cmd.ErrOrStderr(), "  gpupool host drain --selector %s --cancel\n", o.selector)
			} else {
				for _, id := range hostIDs(t.hosts) {
					fmt.Fprintf(cmd.ErrOrStderr(), "  gpupool host drain %s --cancel\n", id)
				}
			}
			return nil
		}
		if err != nil {
			return err
		}
		final = hosts
	}
	if global.output == "json" {
		if len(final) == 1 {
			return printJSON(out, final[0])
		}
		resp := &gpupoolv1.ListHostsResponse{}
		for _, r := range final {
			resp.Hosts = append(resp.Hosts, r.GetHost())
		}
		return printJSON(out, resp)
	}
	return nil
}

// confirmPrefix asks before draining the hosts a HOST_ID matched only as a
// prefix, even one (gpu-1 names gpu-10 when there is no gpu-1). Under --yes
// or without a terminal it refuses: a prefix is too easy to get wrong for a
// script to act on.
func confirmPrefix(cmd *cobra.Command, o *drainOpts, t drainTargets) error {
	ids := hostIDs(t.hosts)
	what := fmt.Sprintf("HOST_ID %q matches %d hosts (%s)", t.prefix, len(ids), strings.Join(ids, ", "))
	all := fmt.Sprintf("all %d", len(ids))
	if len(ids) == 1 {
		what = fmt.Sprintf("HOST_ID %q is no host; it is a prefix of %s", t.prefix, ids[0])
		all = ids[0]
	}
	if o.yes {
		return usagef("%s: --yes does not confirm a prefix; name one host exactly, or pick hosts by label with --selector", what)
	}
	if !stdinIsTerminal(cmd.InOrStdin()) {
		return usagef("%s and stdin is not a terminal to confirm: name one host exactly, or pick hosts by label with --selector", what)
	}
	verb := "Drain"
	if o.cancel {
		verb = "Cancel the drain of"
	}
	ok, err := confirm(cmd.InOrStdin(), cmd.ErrOrStderr(), fmt.Sprintf("%s. %s %s?", what, verb, all))
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("not confirmed; nothing changed")
	}
	return nil
}

// printDrainStarted prints what a drain request did to one host.
func printDrainStarted(w io.Writer, resp *gpupoolv1.DrainHostResponse, now time.Time) {
	h := resp.GetHost()
	fmt.Fprintf(w, "host %s: %s, eligible=%s, %s on it", h.GetId(), enumLabel(h.GetStatus()), yesNo(h.GetEligible()), leasesText(int(resp.GetLeases())))
	if d := h.GetDrain(); d != nil {
		fmt.Fprintf(w, "; %s", deadlineText(d, now))
	}
	fmt.Fprintln(w)
}

// deadlineText is "deadline in 59m (14:05:00 UTC)", "no deadline" or
// "forced".
func deadlineText(d *gpupoolv1.HostDrain, now time.Time) string {
	switch {
	case d.GetForce():
		return "leases revoked (forced or past the deadline)"
	case d.GetDeadlineMs() == 0:
		return "no deadline"
	}
	at := time.UnixMilli(d.GetDeadlineMs())
	if left := at.Sub(now).Round(time.Second); left > 0 {
		return fmt.Sprintf("deadline in %s (%s)", humanDuration(left), at.UTC().Format("15:04:05 UTC"))
	}
	return fmt.Sprintf("deadline passed (%s): revoking", at.UTC().Format("15:04:05 UTC"))
}

// errDetached means the operator pressed Ctrl-C while monitoring.
var errDetached = errors.New("detached")

// drainLine is a host's progress: "gpu-3: draining, 2 leases left,
// deadline in 58m (14:05:00 UTC)".
func drainLine(p client.DrainProgress, now time.Time) string {
	id := p.Host
	if p.Err != nil {
		return fmt.Sprintf("%s: %s", id, status.Convert(p.Err).Message())
	}
	h := p.Resp.GetHost()
	switch {
	case h.GetDrain() == nil:
		return fmt.Sprintf("%s: drain cancelled (%s)", id, enumLabel(h.GetStatus()))
	case h.GetStatus() == gpupoolv1.HostStatus_HOST_STATUS_DRAINED:
		return fmt.Sprintf("%s: drained", id)
	}
	return fmt.Sprintf("%s: %s, %s left, %s", id, enumLabel(h.GetStatus()), leasesText(len(p.Resp.GetLeases())), deadlineText(h.GetDrain(), now))
}

// monitorDrain shows the drain of hosts until every one is done, and
// returns their final state. On a terminal it redraws one line every
// second; otherwise it prints a line whenever the leases left or a status
// change. It returns errDetached when ctx ends (Ctrl-C).
func monitorDrain(ctx context.Context, c *client.Client, w io.Writer, ids []string, redraw bool) ([]*gpupoolv1.DrainHostResponse, error) {
	last := ""
	out, err := c.WatchDrain(ctx, ids, time.Second, global.timeout, func(prog []client.DrainProgress) {
		now := time.Now()
		var lines, keys []string
		for _, p := range prog {
			lines = append(lines, drainLine(p, now))
			keys = append(keys, drainLine(p, time.Time{}))
		}
		text := strings.Join(lines, "; ")
		if redraw {
			fmt.Fprintf(w, "\r\033[K%s", text)
		} else if key := strings.Join(keys, "; "); key != last {
			fmt.Fprintln(w, text)
			last = key
		}
	})
	if ctx.Err() != nil {
		return nil, errDetached
	}
	if err != nil {
		return nil, err
	}
	if redraw {
		fmt.Fprintln(w)
	}
	for _, r := range out {
		if h := r.GetHost(); h.GetStatus() == gpupoolv1.HostStatus_HOST_STATUS_DRAINED {
			fmt.Fprintf(w, "host %s is drained and stays out of the pool until 'gpupool host eligibility %s --enable'\n", h.GetId(), h.GetId())
		}
	}
	return out, nil
}

func newHostEligibilityCmd() *cobra.Command {
	var enable, disable bool
	cmd := &cobra.Command{
		Use:   "eligibility HOST_ID --enable|--disable",
		Short: "Let a host take new leases, or stop it without draining",
		Long: `Eligibility decides whether new leases may land on a host. --disable keeps
the leases already there running (use 'gpupool host drain' to move them off).
--enable puts a drained host back in the pool and ends its drain; a host still
draining is refused: cancel the drain with 'gpupool host drain HOST_ID --cancel'.`,
		Example: `  gpupool host eligibility gpu-node-3 --enable
  gpupool host eligibility gpu-node-3 --disable`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if enable == disable {
				return usagef("give exactly one of --enable and --disable")
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Pool.SetEligibility(ctx, &gpupoolv1.SetEligibilityRequest{HostId: args[0], Eligible: enable})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					h := resp.GetHost()
					_, err := fmt.Fprintf(w, "host %s: %s, eligible=%s\n", h.GetId(), enumLabel(h.GetStatus()), yesNo(h.GetEligible()))
					return err
				})
			})
		},
	}
	cmd.Flags().BoolVar(&enable, "enable", false, "let the host take new leases (ends a finished drain)")
	cmd.Flags().BoolVar(&disable, "disable", false, "stop new leases landing on the host")
	return cmd
}

// leasesText is "1 lease" or "n leases".
func leasesText(n int) string {
	if n == 1 {
		return "1 lease"
	}
	return fmt.Sprintf("%d leases", n)
}
