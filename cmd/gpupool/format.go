package main

// Helpers shared by the client commands (lease, host, status, operator):
// positional-argument checks that fail as usage errors, enum flags read
// from the proto enums, the table-or-JSON switch, and the formatting of
// leases, sizes and ages in tables.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// usageArgs wraps a cobra argument check so that its complaint is a usage
// error (exit 2) that shows the command's synopsis.
func usageArgs(check cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			return usagef("%s: %v; usage: %s", cmd.CommandPath(), err, cmd.UseLine())
		}
		return nil
	}
}

// exactArgs is cobra.ExactArgs failing as a usage error.
func exactArgs(n int) cobra.PositionalArgs { return usageArgs(cobra.ExactArgs(n)) }

// minArgs is cobra.MinimumNArgs failing as a usage error.
func minArgs(n int) cobra.PositionalArgs { return usageArgs(cobra.MinimumNArgs(n)) }

// commandAfterDash accepts the arguments of a command that runs the
// command given after --, as example does; nothing may come before --.
func commandAfterDash(example string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if cmd.ArgsLenAtDash() < 0 || len(args) == 0 {
			return usagef("give the command after --, e.g. %s", example)
		}
		if cmd.ArgsLenAtDash() > 0 {
			return usagef("unexpected %q before --: flags go before --, the command after it", args[0])
		}
		return nil
	}
}

// newGroupCmd makes cmd a holder of subcommands. Run bare, it prints its
// help; run with an unknown subcommand, it fails as a usage error that
// lists the subcommands.
func newGroupCmd(cmd *cobra.Command, subs ...*cobra.Command) *cobra.Command {
	cmd.AddCommand(subs...)
	cmd.Args = cobra.ArbitraryArgs
	cmd.SuggestionsMinimumDistance = 2
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return cmd.Help()
		}
		var names []string
		for _, c := range cmd.Commands() {
			if c.IsAvailableCommand() {
				names = append(names, c.Name())
			}
		}
		msg := fmt.Sprintf("unknown command %q for %q; choose one of: %s", args[0], cmd.CommandPath(), strings.Join(names, ", "))
		if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
			msg += fmt.Sprintf(" (did you mean %q?)", s[0])
		}
		return usagef("%s", msg)
	}
	return cmd
}

// withClient dials the brokers named by --addr (checking -o first) and
// calls fn with a context bounded by --timeout.
func withClient(cmd *cobra.Command, fn func(ctx context.Context, c *client.Client) error) error {
	c, err := dial()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := callCtx(cmd)
	defer cancel()
	return fn(ctx, c)
}

// render prints m as JSON under -o json, its id under -o name (and -q),
// and calls table otherwise.
func render(w io.Writer, m proto.Message, table func(io.Writer) error) error {
	switch global.output {
	case "json":
		return printJSON(w, m)
	case "name":
		if id := messageID(m); id != "" {
			_, err := fmt.Fprintln(w, id)
			return err
		}
	}
	return table(w)
}

// messageID is the string field "id" (or "accessor_id") of m, "" if none.
func messageID(m proto.Message) string {
	r := m.ProtoReflect()
	for _, name := range []protoreflect.Name{"id", "accessor_id"} {
		if f := r.Descriptor().Fields().ByName(name); f != nil && f.Kind() == protoreflect.StringKind {
			return r.Get(f).String()
		}
	}
	return ""
}

// renderList prints a list: JSON under -o json; the ids, one a line, under
// -o name and -q; "no NOUN" when it is empty (unless noun is "": the table
// then says it); the table otherwise.
func renderList(w io.Writer, m proto.Message, noun string, ids []string, table func(io.Writer) error) error {
	switch {
	case global.output == "json":
		return printJSON(w, m)
	case global.output == "name":
		for _, id := range ids {
			if _, err := fmt.Fprintln(w, id); err != nil {
				return err
			}
		}
		return nil
	case len(ids) == 0 && noun != "":
		_, err := fmt.Fprintln(w, "no "+noun)
		return err
	}
	return table(w)
}

// idsOf maps a list to its ids.
func idsOf[T any](items []T, id func(T) string) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = id(it)
	}
	return out
}

// addStaleFlag adds --stale, for reads that may be served by any server.
func addStaleFlag(cmd *cobra.Command, stale *bool) {
	cmd.Flags().BoolVar(stale, "stale", false, "serve from the answering server's local state instead of the leader's (faster, may lag behind)")
}

// flagValueError turns a parse error for a flag's value into a usage
// error that names the flag, the value and the allowed form.
func flagValueError(flag string, err error) error {
	var qe *quantity.Error
	if errors.As(err, &qe) {
		return usagef("--%s %q: %s", flag, qe.Value, qe.Reason)
	}
	return usagef("--%s: %v", flag, err)
}

// parseMemoryFlag parses a memory flag value (see quantity.ParseMemoryMiB);
// min is the smallest allowed value in MiB.
func parseMemoryFlag(flag, value string, min int64) (int64, error) {
	n, err := quantity.ParseMemoryMiB(value)
	if err != nil {
		return 0, flagValueError(flag, err)
	}
	if n < min {
		return 0, usagef("--%s %q: must be at least %s", flag, value, quantity.FormatMiB(min))
	}
	return n, nil
}

// protoEnum is a generated protobuf enum type.
type protoEnum = protocol.Enum

// enumLabel is the name users read and type for an enum value (see
// protocol.EnumLabel).
func enumLabel[T protoEnum](v T) string { return protocol.EnumLabel(v) }

// enumLabels lists the labels of every value of T but the zero one, in
// declaration order.
func enumLabels[T protoEnum]() []string { return protocol.EnumLabels[T]() }

// parseEnumFlag reads the value of flag as one of T's labels (see
// enumLabel), ignoring case and accepting _ for -.
func parseEnumFlag[T protoEnum](flag, s string) (T, error) {
	v, ok := protocol.ParseEnumLabel[T](s)
	if !ok {
		return v, usagef("--%s %q: must be one of %s", flag, s, strings.Join(enumLabels[T](), ", "))
	}
	return v, nil
}

// formatMillis formats a duration given in milliseconds the Go way: 10m0s.
func formatMillis(ms int64) string {
	return (time.Duration(ms) * time.Millisecond).String()
}

// humanDuration formats d compactly for an AGE or HEARTBEAT column:
// 850ms, 42s, 12m, 5h, 3d.
func humanDuration(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < time.Second:
		return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
	case d < 2*time.Minute:
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	case d < 2*time.Hour:
		return strconv.FormatInt(int64(d/time.Minute), 10) + "m"
	case d < 48*time.Hour:
		return strconv.FormatInt(int64(d/time.Hour), 10) + "h"
	}
	return strconv.FormatInt(int64(d/(24*time.Hour)), 10) + "d"
}

// ageSince formats how long ago the Unix-millisecond time atMs was, or "-"
// when it is unset.
func ageSince(now time.Time, atMs int64) string {
	if atMs <= 0 {
		return "-"
	}
	return humanDuration(now.Sub(time.UnixMilli(atMs)))
}

// compactMiB is quantity.FormatMiB without the space, for dense columns:
// 20GiB.
func compactMiB(n int64) string {
	return strings.Replace(quantity.FormatMiB(n), " ", "", 1)
}

// leaseStateText is a lease's state for tables: "granted",
// "releasing→expired" while its capacity is being freed, with "(lost)"
// when its host went down.
func leaseStateText(l *gpupoolv1.Lease) string {
	s := enumLabel(l.GetState())
	if l.GetState() == gpupoolv1.LeaseState_LEASE_STATE_RELEASING && l.GetEndState() != 0 {
		s += "→" + enumLabel(l.GetEndState())
	}
	if l.GetLost() {
		s += " (lost)"
	}
	return s
}

// sliceShare is what a slice holds of its device: "20GiB 25%" or
// "exclusive".
func sliceShare(s *gpupoolv1.Slice) string {
	if s.GetExclusive() {
		return "exclusive"
	}
	return fmt.Sprintf("%s %d%%", compactMiB(s.GetMemoryMib()), s.GetComputePercent())
}

// maxSlicesInCell is how many slices a list row shows before it folds
// them into a count (-o wide shows them all).
const maxSlicesInCell = 2

// sliceCell is sliceSummary for a list row: with more than
// maxSlicesInCell slices, "7 slices on 3 hosts" unless -o wide.
func sliceCell(slices []*gpupoolv1.Slice) string {
	if len(slices) <= maxSlicesInCell || global.output == "wide" {
		return sliceSummary(slices)
	}
	hosts := map[string]bool{}
	for _, s := range slices {
		hosts[s.GetHost()] = true
	}
	if len(hosts) == 1 {
		return fmt.Sprintf("%d slices on %s", len(slices), slices[0].GetHost())
	}
	return fmt.Sprintf("%d slices on %d hosts", len(slices), len(hosts))
}

// sliceSummary lists a lease's slices in one cell:
// "host-1/0 20GiB 25%, host-1/1 exclusive".
func sliceSummary(slices []*gpupoolv1.Slice) string {
	if len(slices) == 0 {
		return "-"
	}
	parts := make([]string, len(slices))
	for i, s := range slices {
		parts[i] = fmt.Sprintf("%s/%d %s", s.GetHost(), s.GetDeviceIndex(), sliceShare(s))
	}
	return strings.Join(parts, ", ")
}

// orDash returns s, or "-" when s is empty, so table cells never vanish.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// printLease prints one lease as a table: its identity, state, fencing
// token and TTL, then one row per slice.
func printLease(w io.Writer, l *gpupoolv1.Lease) error {
	kv := newTable(w, "LEASE", l.GetId())
	kv.row("STATE", leaseStateText(l))
	kv.row("FENCING TOKEN", l.GetFencingToken())
	kv.row("TTL", formatMillis(l.GetTtlMs()))
	kv.row("TENANT", orDash(l.GetTenant()))
	kv.row("HOLDER", orDash(l.GetHolder()))
	kv.row("CLASS", enumLabel(l.GetClass()))
	kv.row("REQUEST ID", orDash(l.GetRequestId()))
	if l.GetHostCpuMillicores() != 0 || l.GetHostMemoryMib() != 0 {
		kv.row("HOST CPU/MEMORY", fmt.Sprintf("%dm / %s", l.GetHostCpuMillicores(), quantity.FormatMiB(l.GetHostMemoryMib())))
	}
	if m := l.GetRequest().GetElasticMax(); m > 0 {
		kv.row("ELASTIC", fmt.Sprintf("%d..%d slices: %d guaranteed, extras while capacity is free", l.GetRequest().GetCount(), m, l.GetRequest().GetCount()))
	}
	if l.GetParent() != "" {
		kv.row("PARENT", l.GetParent()+" (this lease is an extra of that elastic lease)")
	}
	if l.GetState() == gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		kv.row("PENDING", orDash(l.GetPendingReason()))
	}
	if l.GetPreemptAtMs() > 0 {
		kv.row("PREEMPTED", fmt.Sprintf("at %s for %s", formatTimeMs(l.GetPreemptAtMs()), orDash(l.GetPreemptedFor())))
	}
	if l.GetReason() != "" {
		kv.row("REASON", l.GetReason())
	}
	if a := l.GetGrantedBy(); a != nil {
		kv.row("GRANTED BY", protocol.ActorText(a))
	}
	if a := l.GetEndedBy(); a != nil {
		kv.row("ENDED BY", protocol.ActorText(a))
	}
	if l.GetViolations() > 0 {
		kv.row("VIOLATIONS", fmt.Sprintf("%d, last: %s", l.GetViolations(), l.GetLastViolation()))
	}
	if err := kv.flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	usage := map[string]*gpupoolv1.SliceUsage{} // host/device → usage
	for _, u := range l.GetUsage() {
		for _, su := range u.GetSlices() {
			usage[u.GetHost()+"/"+su.GetDevice()] = su
		}
	}
	t := newTable(w, "HOST", "DEVICE", "INDEX", "MODEL", "MEMORY", "COMPUTE", "ISOLATION", "USED", "UTIL", "PROCS")
	for _, s := range l.GetSlices() {
		memory, compute := quantity.FormatMiB(s.GetMemoryMib()), fmt.Sprintf("%d%%", s.GetComputePercent())
		if s.GetExclusive() {
			compute = "exclusive"
			if s.GetMemoryMib() == 0 {
				memory = "all"
			}
		}
		used, util, procs := "-", "-", "-"
		if u := usage[s.GetHost()+"/"+s.GetDevice()]; u != nil {
			used, procs = quantity.FormatMiB(u.GetMemoryUsedMib()), fmt.Sprint(u.GetProcesses())
			if u.GetUtilizationPercent() >= 0 {
				util = fmt.Sprintf("%d%%", u.GetUtilizationPercent())
			}
		}
		t.row(s.GetHost(), s.GetDevice(), s.GetDeviceIndex(), orDash(s.GetModel()), memory, compute,
			enumLabel(s.GetIsolation()), used, util, procs)
	}
	if err := t.flush(); err != nil {
		return err
	}
	if len(l.GetSlices()) > 0 && len(l.GetUsage()) == 0 && !protocol.LeaseEnded(l.GetState()) {
		_, err := fmt.Fprintln(w, "\nUSED, UTIL and PROCS come from the agents through the leader: none reported yet (or --stale).")
		return err
	}
	return nil
}

// sortLeases orders leases oldest first (newest last), by creation time,
// then id.
func sortLeases(leases []*gpupoolv1.Lease) {
	slices.SortStableFunc(leases, func(a, b *gpupoolv1.Lease) int {
		if c := cmp.Compare(a.GetCreatedAtMs(), b.GetCreatedAtMs()); c != 0 {
			return c
		}
		return cmp.Compare(a.GetId(), b.GetId())
	})
}

// printLeases prints leases one per row, ages counted from now.
func printLeases(w io.Writer, leases []*gpupoolv1.Lease, now time.Time) error {
	t := newTable(w, "ID", "TENANT", "HOLDER", "STATE", "SLICES", "FENCING", "AGE")
	for _, l := range leases {
		t.row(l.GetId(), orDash(l.GetTenant()), orDash(l.GetHolder()), leaseStateText(l),
			sliceCell(l.GetSlices()), l.GetFencingToken(), ageSince(now, l.GetCreatedAtMs()))
	}
	return t.flush()
}

// printPendingLeases prints the leases waiting in the queue, in the order
// the queue serves them (higher priority first, then the longest
// waiting), ages counted from now.
func printPendingLeases(w io.Writer, leases []*gpupoolv1.Lease, now time.Time) error {
	queue := slices.Clone(leases)
	slices.SortStableFunc(queue, func(a, b *gpupoolv1.Lease) int {
		if c := cmp.Compare(b.GetPriority(), a.GetPriority()); c != 0 {
			return c
		}
		return cmp.Compare(a.GetCreatedAtMs(), b.GetCreatedAtMs())
	})
	t := newTable(w, "ID", "TENANT", "HOLDER", "PRIORITY", "WANTS", "WAITING", "WHY")
	for _, l := range queue {
		t.row(l.GetId(), orDash(l.GetTenant()), orDash(l.GetHolder()), l.GetPriority(),
			requestSummary(l.GetRequest()), ageSince(now, l.GetCreatedAtMs()), orDash(l.GetPendingReason()))
	}
	return t.flush()
}

// requestSummary is what a request asks for in one cell: "2× 20GiB 25%",
// "1× exclusive", "2..6× 20GiB 25%" for an elastic one.
func requestSummary(r *gpupoolv1.LeaseRequest) string {
	if r == nil {
		return "-"
	}
	n := strconv.Itoa(int(r.GetCount()))
	if r.GetElasticMax() > 0 {
		n += ".." + strconv.Itoa(int(r.GetElasticMax()))
	}
	if r.GetExclusive() {
		return n + "× exclusive"
	}
	return fmt.Sprintf("%s× %s %d%%", n, compactMiB(r.GetMemoryMib()), r.GetComputePercent())
}

// formatTimeMs formats a Unix-millisecond time for people, in UTC:
// "2026-01-01 12:05:00 UTC".
func formatTimeMs(ms int64) string {
	return time.UnixMilli(ms).UTC().Format("2006-01-02 15:04:05 UTC")
}

// parsePercentFlag parses a percent flag value (see quantity.ParsePercent).
func parsePercentFlag(flag, value string) (int32, error) {
	n, err := quantity.ParsePercent(value)
	if err != nil {
		return 0, flagValueError(flag, err)
	}
	return n, nil
}

// parseLabelFlag reads the key=value pairs given to the repeatable flag
// named flag. A key given twice must have the same value both times.
func parseLabelFlag(flag string, pairs []string) (map[string]string, error) {
	if len(pairs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(pairs))
	for _, p := range pairs {
		k, v, ok := strings.Cut(p, "=")
		k = strings.TrimSpace(k)
		if !ok || k == "" {
			return nil, usagef("--%s %q: want key=value, e.g. --%s zone=eu-1", flag, p, flag)
		}
		if prev, dup := out[k]; dup && prev != v {
			return nil, usagef("--%s %q: label %q is already given as %q; a label has one value", flag, p, k, prev)
		}
		out[k] = v
	}
	return out, nil
}
