package broker

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestUIConfigRefusesBadInputNamingTheFlag(t *testing.T) {
	for _, tc := range []struct {
		name string
		ui   UIConfig
		want string
	}{
		{"an address without a port", UIConfig{Bind: "127.0.0.1"}, "--ui-bind"},
		{"a port only", UIConfig{Bind: "7701"}, "--ui-bind"},
		{"a negative stream cap", UIConfig{Bind: "127.0.0.1:0", StreamsPerToken: -1}, "--ui-streams-per-token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1, UI: tc.ui})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error naming %s", err, tc.want)
			}
		})
	}
}

func TestBrokerServesItsConsoleOnlyWhenAsked(t *testing.T) {
	off := startServer(t)
	if u := off.s.UIURL(); u != "" {
		t.Errorf("without --ui-bind: got console %q, want none", u)
	}
	ts := startServer(t, func(c *Config) { c.UI.Bind = "127.0.0.1:0" })
	ts.registerHost(t, "h1", 2, 81920)
	resp, err := http.Get(ts.s.UIURL())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `id="row-h1"`) {
		t.Errorf("the console's pool page: got %d without h1's row, want 200 with it", resp.StatusCode)
	}
}
