package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

type auditFlags struct {
	since  uint64
	limit  int
	follow bool
	tenant string
	kinds  []string
}

// request checks the flags and returns the request they ask for.
func (f *auditFlags) request() (*gpupoolv1.AuditLogRequest, error) {
	if f.limit < 0 {
		return nil, usagef("--limit %d: must be 0 (every stored entry) or more", f.limit)
	}
	req := &gpupoolv1.AuditLogRequest{SinceIndex: f.since, Limit: uint32(f.limit), Follow: f.follow}
	if f.tenant != "" {
		if err := protocol.ValidateTenant("--tenant", f.tenant); err != nil {
			return nil, usagef("%v", err)
		}
		req.Tenant = f.tenant
	}
	for _, k := range f.kinds {
		kind, err := parseEnumFlag[gpupoolv1.AuditKind]("kind", k)
		if err != nil {
			return nil, err
		}
		req.Kinds = append(req.Kinds, kind)
	}
	return req, nil
}

func newAuditCmd() *cobra.Command {
	var f auditFlags
	cmd := &cobra.Command{
		Use:   "audit [--since INDEX] [--limit N] [--follow] [--tenant T] [--kind K,...]",
		Short: "Show who granted, ended, drained, set quotas and changed tokens",
		Long: `Audit prints the audit log: every lease granted, released, expired, revoked or
preempted, every drain started, changed, cancelled or finished, host
eligibility, quota and ACL token change, with who did it. ACTOR is the ACL
token's name (and the start of its accessor id; -o json has it whole),
"broker" for what the leader does on its own (expiry, a host going down, a
drain deadline, preemption), or "anonymous" on a cluster without ACL.

The brokers write each entry in the same Raft entry as the change, so every
broker holds the same log; this one is served by the broker you reach, which
may lag the leader by a moment. The newest 10,000 entries are kept.

INDEX is the Raft index of the change. --since INDEX shows only later ones,
so 'gpupool operator audit --since N --follow' resumes where a reader
stopped. --limit keeps the newest N of the stored entries that match (0 for
all); --follow then prints each new entry as it applies, until Ctrl-C.

A management token sees every entry. A client token sees its tenants'
lease and quota entries only.

Kinds (--kind): ` + wrapWords(strings.Join(enumLabels[gpupoolv1.AuditKind](), ", ")+".", 78-len("Kinds (--kind): ")) + `

With -o json, entries are one JSON array, or under --follow one JSON object
per line.`,
		Example: `  # The last 100 entries
  gpupool operator audit

  # Who drained or touched host eligibility, and keep watching
  gpupool operator audit --kind host-drain-started,host-drain-cancelled,host-eligibility --follow

  # Everything about tenant sim since Raft index 1200, as JSON
  gpupool operator audit --tenant sim --since 1200 --limit 0 -o json`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := f.request()
			if err != nil {
				return err
			}
			if err := checkOutput(); err != nil {
				return err
			}
			c, err := dial()
			if err != nil {
				return err
			}
			defer c.Close()
			return runAudit(cmd, c, req)
		},
	}
	fs := cmd.Flags()
	fs.Uint64Var(&f.since, "since", 0, "show only entries of Raft indexes after INDEX")
	fs.IntVar(&f.limit, "limit", 100, "show at most the newest N stored entries that match; 0 for every stored entry")
	fs.BoolVarP(&f.follow, "follow", "f", false, "keep printing new entries as they apply, until Ctrl-C")
	fs.StringVar(&f.tenant, "tenant", "", "show only entries of this tenant (its leases and quota)")
	fs.StringSliceVar(&f.kinds, "kind", nil, "show only these kinds, comma-separated: "+strings.Join(enumLabels[gpupoolv1.AuditKind](), ", "))
	return cmd
}

// runAudit prints the stored entries, then under follow the new ones. A
// follow the broker ends (it restarted, or the reader fell behind) is
// resumed after the last entry printed.
func runAudit(cmd *cobra.Command, c *client.Client, req *gpupoolv1.AuditLogRequest) error {
	ctx := cmd.Context()
	if !req.Follow {
		var cancel context.CancelFunc
		ctx, cancel = callCtx(cmd)
		defer cancel()
	}
	p := newAuditPrinter(cmd.OutOrStdout())
	var lastIndex uint64
	var lastSeq uint32
	seen := false
	backoff := 250 * time.Millisecond
	for {
		s, err := c.Operator.AuditLog(ctx, req)
		var backlog []*gpupoolv1.AuditEntry
		for err == nil {
			var e *gpupoolv1.AuditEntry
			e, err = s.Recv()
			if err != nil {
				break
			}
			if seen && (e.Index < lastIndex || e.Index == lastIndex && e.Seq <= lastSeq) {
				continue // resent after a resume
			}
			lastIndex, lastSeq, seen = e.Index, e.Seq, true
			backoff = 250 * time.Millisecond
			if !req.Follow {
				backlog = append(backlog, e)
				continue
			}
			if err = p.follow(e); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) {
			return p.all(backlog)
		}
		if ctx.Err() != nil {
			if req.Follow {
				return nil // Ctrl-C
			}
			return err
		}
		code := status.Code(err)
		if code != codes.Unavailable && code != codes.ResourceExhausted {
			return err
		}
		if !req.Follow {
			// A list is asked again only while nothing of it has come
			// (a broker electing or catching up), until the call's
			// deadline; one that broke midway is not pieced together.
			if seen {
				return err
			}
			select {
			case <-ctx.Done():
				return err
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 5*time.Second)
			continue
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "audit follow interrupted (%s); resuming after index %d in %s\n", status.Convert(err).Message(), lastIndex, backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
		// Entries of lastIndex after lastSeq may not have been sent: ask
		// from the index before and skip what was printed.
		if seen {
			req.SinceIndex = max(lastIndex, 1) - 1
		}
		req.Limit = 0
	}
}

// auditPrinter prints entries as a table whose columns grow to fit, or as
// JSON: an array for a list, one object per line under follow.
type auditPrinter struct {
	w      io.Writer
	json   bool
	widths []int
	header bool
}

var auditHeader = []string{"TIME", "INDEX", "KIND", "ACTOR", "SUBJECT", "TENANT", "DETAIL"}

func newAuditPrinter(w io.Writer) *auditPrinter {
	return &auditPrinter{w: w, json: global.output == "json", widths: make([]int, len(auditHeader))}
}

// all prints a whole list.
func (p *auditPrinter) all(entries []*gpupoolv1.AuditEntry) error {
	if p.json {
		out := make([]json.RawMessage, 0, len(entries))
		for _, e := range entries {
			b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(e)
			if err != nil {
				return err
			}
			out = append(out, b)
		}
		b, err := json.MarshalIndent(out, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(p.w, string(b))
		return err
	}
	rows := [][]string{auditHeader}
	for _, e := range entries {
		rows = append(rows, auditRow(e))
	}
	for _, r := range rows {
		p.fit(r)
	}
	for _, r := range rows {
		if err := p.row(r); err != nil {
			return err
		}
	}
	return nil
}

// follow prints one entry as it arrives.
func (p *auditPrinter) follow(e *gpupoolv1.AuditEntry) error {
	if p.json {
		b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(e)
		if err != nil {
			return err
		}
		// protojson varies its spacing; compact it for one line per entry.
		var v any
		if err := json.Unmarshal(b, &v); err != nil {
			return err
		}
		if b, err = json.Marshal(v); err != nil {
			return err
		}
		_, err = fmt.Fprintln(p.w, string(b))
		return err
	}
	if !p.header {
		p.header = true
		p.fit(auditHeader)
		p.fit(auditRow(e))
		if err := p.row(auditHeader); err != nil {
			return err
		}
	}
	r := auditRow(e)
	p.fit(r)
	return p.row(r)
}

func (p *auditPrinter) fit(r []string) {
	for i, c := range r {
		p.widths[i] = max(p.widths[i], len(c))
	}
}

func (p *auditPrinter) row(r []string) error {
	var b strings.Builder
	for i, c := range r {
		if i == len(r)-1 {
			b.WriteString(c)
			break
		}
		b.WriteString(c)
		b.WriteString(strings.Repeat(" ", p.widths[i]-len(c)+2))
	}
	_, err := fmt.Fprintln(p.w, strings.TrimRight(b.String(), " "))
	return err
}

// wrapWords breaks s into lines of at most width characters where it can.
func wrapWords(s string, width int) string {
	var b strings.Builder
	n := 0
	for i, w := range strings.Fields(s) {
		if i > 0 && n+1+len(w) > width {
			b.WriteString("\n")
			n = 0
		} else if i > 0 {
			b.WriteString(" ")
			n++
		}
		b.WriteString(w)
		n += len(w)
	}
	return b.String()
}

func auditRow(e *gpupoolv1.AuditEntry) []string {
	at := "-"
	if e.AtMs > 0 {
		at = time.UnixMilli(e.AtMs).UTC().Format(time.RFC3339)
	}
	return []string{at, strconv.FormatUint(e.Index, 10), enumLabel(e.Kind), actorCell(e.Actor), e.Subject, orDash(e.Tenant), e.Detail}
}

// actorCell is an actor in a table: its name and the first 8 characters
// of its accessor id, enough to tell two tokens of one name apart.
func actorCell(a *gpupoolv1.Actor) string {
	switch {
	case a == nil:
		return "-"
	case a.AccessorId == "":
		return a.Name
	}
	return fmt.Sprintf("%s (%s)", a.Name, a.AccessorId[:min(8, len(a.AccessorId))])
}
