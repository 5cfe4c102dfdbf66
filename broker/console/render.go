package console

import (
	"errors"
	"fmt"
	"html/template"
	"io"
	"net/url"
	"strings"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// escapeHTML escapes a string for HTML text and quoted attributes.
func escapeHTML(s string) string { return template.HTMLEscapeString(s) }

// escapeURLPath escapes an id for one segment of a URL path (then it is
// safe in a quoted attribute too).
func escapeURLPath(s string) string { return escapeHTML(url.PathEscape(s)) }

func isEOF(err error) bool { return errors.Is(err, io.EOF) }

func parseTemplates() (*template.Template, error) {
	return template.New("console").Funcs(template.FuncMap{
		"state":  stateName,
		"class":  className,
		"mib":    mib,
		"status": hostStatusName,
		"health": healthName,
		"when": func(ms int64) string {
			if ms <= 0 {
				return "-"
			}
			return time.UnixMilli(ms).UTC().Format("2006-01-02 15:04:05Z")
		},
		"ago": func(ms int64) string {
			if ms <= 0 {
				return "-"
			}
			return time.Since(time.UnixMilli(ms)).Round(time.Second).String() + " ago"
		},
		"dur": func(ms int64) string { return (time.Duration(ms) * time.Millisecond).String() },
		"now": func() int64 { return time.Now().UnixMilli() },
		"isolation": func(i gpupoolv1.Isolation) string {
			return strings.ToLower(strings.TrimPrefix(i.String(), "ISOLATION_"))
		},
		"auditKind": func(k gpupoolv1.AuditKind) string {
			return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(k.String(), "AUDIT_KIND_")), "_", " ")
		},
		"actor": func(a *gpupoolv1.Actor) string {
			switch {
			case a == nil:
				return "-"
			case a.AccessorId == "":
				return a.Name
			}
			return fmt.Sprintf("%s (%s)", a.Name, a.AccessorId)
		},
		"slice": func(sl *gpupoolv1.Slice) string {
			if sl.Exclusive {
				return fmt.Sprintf("%s GPU %d (%s): whole GPU", sl.Host, sl.DeviceIndex, sl.Model)
			}
			return fmt.Sprintf("%s GPU %d (%s): %s, %d%% compute", sl.Host, sl.DeviceIndex, sl.Model, mib(sl.MemoryMib), sl.ComputePercent)
		},
		"until":   func(ms int64) string { return untilText(ms, time.Now()) },
		"reserve": reservedPercent,
		"pathseg": url.PathEscape,
		"hbAge": func(ms int64) string {
			switch {
			case ms < 0:
				return "unknown (not from the leader)"
			}
			return (time.Duration(ms) * time.Millisecond).Round(100 * time.Millisecond).String()
		},
		"sinceMs": func(ageMs int64) int64 { return time.Now().UnixMilli() - ageMs },
		"held": func(l *gpupoolv1.Lease) bool {
			return l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.State == gpupoolv1.LeaseState_LEASE_STATE_RELEASING
		},
		"add": func(a, b int) int { return a + b },
		"eventType": func(t gpupoolv1.LeaseEventType) string {
			return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(t.String(), "LEASE_EVENT_TYPE_")), "_", " ")
		},
	}).ParseFS(assets, "assets/templates/*.html")
}
