package console

import (
	"net/url"
	"reflect"
	"strings"
	"testing"
)

func TestParseFiltersAcceptsEachPagesFiltersOnly(t *testing.T) {
	for _, tc := range []struct {
		name    string
		page    pageKind
		query   string
		id      string
		wantErr string
	}{
		{"the pool by model, label and tenant", pagePool, "model=A100*&label=zone%3Da&tenant=sim", "", ""},
		{"leases by state list and class", pageLeases, "state=granted,pending&class=preemptible&host=h1&q=job", "", ""},
		{"a filter of another page", pagePool, "state=granted", "", `unknown filter "state": the pool page filters by model, label, tenant`},
		{"a host page without an id", pageHost, "", "", "must name one host"},
		{"a lease id with a slash", pageLease, "", "a/b", "must name one lease"},
		{"a state that does not exist", pageLeases, "state=granted,sleeping", "", `filter state "sleeping"`},
		{"an over-long value", pageLeases, "q=" + string(make([]byte, 300)), "", "at most 256 characters"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q, _ := url.ParseQuery(tc.query)
			_, err := parseFilters(tc.page, q, tc.id)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("got %v, want no error", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("got %v, want an error saying %q", err, tc.wantErr)
			}
		})
	}
}

// FuzzParseFilters: any query either is refused or round-trips through
// the stream's query string to the same filters.
func FuzzParseFilters(f *testing.F) {
	f.Add(0, "model=A100*&label=zone%3Da&tenant=sim", "")
	f.Add(2, "state=granted,pending&class=guaranteed&q=x", "")
	f.Add(1, "gpu=3", "host-1")
	f.Add(0, "tenant=a&tenant=b", "")
	f.Fuzz(func(t *testing.T, page int, query, id string) {
		k := pageKind(((page % len(pages)) + len(pages)) % len(pages))
		q, err := url.ParseQuery(query)
		if err != nil {
			return
		}
		got, err := parseFilters(k, q, id)
		if err != nil {
			return
		}
		again, err := url.ParseQuery(got.query(k))
		if err != nil {
			t.Fatalf("query %q of %+v: %v", got.query(k), got, err)
		}
		back, err := parseFilters(k, again, again.Get("id"), "page", "id")
		if err != nil {
			t.Fatalf("the stream's query %q of %+v is refused: %v", got.query(k), got, err)
		}
		if !reflect.DeepEqual(back, got) {
			t.Fatalf("round trip: got %+v, want %+v", back, got)
		}
	})
}
