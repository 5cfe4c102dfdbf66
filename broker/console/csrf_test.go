package console

import (
	"net/http"
	"strings"
	"testing"
)

func TestCrossOriginAcceptsOnlyTheConsolesOwnOrigin(t *testing.T) {
	for _, tc := range []struct {
		name string
		tls  bool
		hdr  map[string]string
		want string // "": accepted
	}{
		{"no header at all passes on to the CSRF token", false, nil, ""},
		{"the same origin over HTTP", false, map[string]string{"Origin": "http://console.example:7701", "Sec-Fetch-Site": "same-origin"}, ""},
		{"the same origin over HTTPS", true, map[string]string{"Origin": "https://console.example:7701"}, ""},
		{"a host's name in another case is the same origin", true, map[string]string{"Origin": "https://CONSOLE.example:7701"}, ""},
		{"HTTP origin of an HTTPS console", true, map[string]string{"Origin": "http://console.example:7701"}, "Origin is"},
		{"another port", false, map[string]string{"Origin": "http://console.example:7702"}, "Origin is"},
		{"another host of the site", false, map[string]string{"Origin": "http://evil.console.example:7701"}, "Origin is"},
		{"an origin with a path", false, map[string]string{"Origin": "http://console.example:7701/x"}, "Origin is"},
		{"same-site", false, map[string]string{"Sec-Fetch-Site": "same-site"}, "Sec-Fetch-Site is"},
		{"cross-site", false, map[string]string{"Sec-Fetch-Site": "cross-site"}, "Sec-Fetch-Site is"},
		{"none (typed in, not a form)", false, map[string]string{"Sec-Fetch-Site": "none"}, "Sec-Fetch-Site is"},
		{"same-origin by Sec-Fetch-Site but Origin elsewhere", false, map[string]string{"Sec-Fetch-Site": "same-origin", "Origin": "http://evil.example"}, "Origin is"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _ := http.NewRequest(http.MethodPost, "/signin", nil)
			r.Host = "console.example:7701"
			for k, v := range tc.hdr {
				r.Header.Set(k, v)
			}
			got := crossOrigin(r, tc.tls)
			if (got == "") != (tc.want == "") || !strings.Contains(got, tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestCSRFTokensAreBoundToTheirPurposeAndCookie(t *testing.T) {
	k := newCSRFKeys()
	tok := k.token(csrfSignOut, "session-1")
	for _, tc := range []struct {
		name    string
		purpose csrfPurpose
		binding string
		got     string
		want    bool
	}{
		{"its own purpose and cookie", csrfSignOut, "session-1", tok, true},
		{"another cookie", csrfSignOut, "session-2", tok, false},
		{"another purpose", csrfSignIn, "session-1", tok, false},
		{"no cookie", csrfSignOut, "", k.token(csrfSignOut, ""), false},
		{"no token", csrfSignOut, "session-1", "", false},
		{"another process's key", csrfSignOut, "session-1", newCSRFKeys().token(csrfSignOut, "session-1"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := k.valid(tc.purpose, tc.binding, tc.got); got != tc.want {
				t.Errorf("valid: got %v, want %v", got, tc.want)
			}
		})
	}
}
