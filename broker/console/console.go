// Package console is the broker's read-only web console: server-rendered
// pages of the pool, hosts, leases, the queue, tenants and the cluster,
// kept live with server-sent events.
//
// The console has no privilege: every page and every stream is read
// through the broker's gRPC API with the signed-in user's ACL token, so the
// API's checks (token valid, right, tenant scope) are the console's
// checks, and a follower's console gets leader memory (heartbeats,
// measured usage) from the leader as any API client does. It never writes
// to the pool: its only forms are sign-in and sign-out.
//
// Its one state is its sign-in sessions, kept in this broker's memory
// only: the browser's cookie holds a random session id (256 bits), never
// the token's secret, which stays in the session on the server. A session
// ends after Sessions.Idle unused (30m), Sessions.Lifetime after sign-in
// (12h), at sign-out, when its token expires, and at the first request
// after the broker refuses its token (revoked); at most Sessions.Max
// (10000) are kept, and a sign-in at the bound ends the idlest. Sessions
// are not replicated: a user signs in again on another broker and after a
// restart. Replicating them would put every signed-in secret in the Raft
// log and snapshots of every broker, and buy only not typing a token
// again on a read-only console.
//
// Sign-in and sign-out accept only this console's own pages (csrf.go):
// Sec-Fetch-Site and Origin must say same-origin when sent, and the form
// must carry its CSRF token, bound to a pre-session cookie for sign-in and
// to the session for sign-out.
//
// Every string from users (holders, labels, reasons, tenants) reaches the
// page through html/template or template.HTMLEscapeString; the assets are
// embedded and nothing is fetched at run time.
package console

import (
	"context"
	"crypto/tls"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

//go:embed assets
var assets embed.FS

// Defaults of Config.
const (
	DefaultStreamsPerToken = 8
	// maxBodyBytes caps a request body (the sign-in form).
	maxBodyBytes = 16 << 10
	// maxHeaderBytes caps a request's headers.
	maxHeaderBytes = 32 << 10
)

// Timeouts of the console's HTTP server; streams extend their write
// deadline at every event.
type Timeouts struct {
	ReadHeader time.Duration // default 5s
	Read       time.Duration // default 10s
	Write      time.Duration // default 30s; a stream's per event
	Idle       time.Duration // default 60s
}

func (t *Timeouts) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&t.ReadHeader, 5*time.Second)
	def(&t.Read, 10*time.Second)
	def(&t.Write, 30*time.Second)
	def(&t.Idle, 60*time.Second)
}

// Config configures a console.
type Config struct {
	// Bind is the listen address; Listener, when set, is used instead.
	Bind     string
	Listener net.Listener
	// Conn reaches the broker's gRPC API (the broker's own server).
	Conn grpc.ClientConnInterface
	// ACL says whether the broker checks tokens: on, users sign in; off,
	// the console is open and says so.
	ACL bool
	// TLS, when set, serves HTTPS and marks the cookie Secure.
	TLS *tls.Config
	// ServerID names the broker in the header.
	ServerID string
	// StreamsPerToken caps the live streams one token (or, with ACL off,
	// one client address) holds open at once.
	StreamsPerToken int
	// LiveInterval is how often pages refresh what changes without an
	// event (usage, ages, the audit log); default 2s.
	LiveInterval time.Duration
	Timeouts     Timeouts
	// Sessions bounds the sign-in sessions (idle, lifetime, how many).
	Sessions Sessions
	// Clock times sessions; default the wall clock.
	Clock  clock.Clock
	Logger *slog.Logger
}

// Server is a running console.
type Server struct {
	cfg     Config
	log     *slog.Logger
	http    *http.Server
	lis     net.Listener
	api     apiClients
	tpl     *template.Template
	streams *streamLimiter
	// sessions are the signed-in browsers; csrf signs their forms.
	sessions *sessionStore
	csrf     *csrfKeys
	// baselines are pages' renders their streams start from.
	baselines *baselines
	// ctx ends the live streams when the console closes.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type apiClients struct {
	lease    gpupoolv1.LeaseServiceClient
	pool     gpupoolv1.PoolServiceClient
	operator gpupoolv1.OperatorServiceClient
	acl      gpupoolv1.AclServiceClient
}

// New starts serving the console.
func New(cfg Config) (*Server, error) {
	if cfg.Conn == nil {
		return nil, errors.New("console: no connection to the broker")
	}
	if cfg.StreamsPerToken <= 0 {
		cfg.StreamsPerToken = DefaultStreamsPerToken
	}
	if cfg.LiveInterval <= 0 {
		cfg.LiveInterval = 2 * time.Second
	}
	cfg.Timeouts.setDefaults()
	cfg.Sessions.setDefaults()
	if cfg.Clock == nil {
		cfg.Clock = clock.Real
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	tpl, err := parseTemplates()
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg: cfg, log: cfg.Logger, tpl: tpl,
		api: apiClients{
			lease: gpupoolv1.NewLeaseServiceClient(cfg.Conn), pool: gpupoolv1.NewPoolServiceClient(cfg.Conn),
			operator: gpupoolv1.NewOperatorServiceClient(cfg.Conn), acl: gpupoolv1.NewAclServiceClient(cfg.Conn),
		},
		streams:   newStreamLimiter(cfg.StreamsPerToken),
		sessions:  newSessionStore(cfg.Sessions, cfg.Clock),
		csrf:      newCSRFKeys(),
		baselines: newBaselines(),
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	lis := cfg.Listener
	if lis == nil {
		if lis, err = net.Listen("tcp", cfg.Bind); err != nil {
			return nil, fmt.Errorf("console: listen: %w", err)
		}
	}
	s.lis = lis
	t := cfg.Timeouts
	s.http = &http.Server{
		Handler:           s.Handler(),
		ReadHeaderTimeout: t.ReadHeader,
		ReadTimeout:       t.Read,
		WriteTimeout:      t.Write,
		IdleTimeout:       t.Idle,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelDebug),
		BaseContext:       func(net.Listener) context.Context { return s.ctx },
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		var err error
		if cfg.TLS != nil {
			// ServeTLS also offers HTTP/2, so that a user's many open
			// pages share one connection instead of HTTP/1.1's six.
			s.http.TLSConfig = cfg.TLS.Clone()
			err = s.http.ServeTLS(lis, "", "")
		} else {
			err = s.http.Serve(lis)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Warn("console stopped serving", "err", err)
		}
	}()
	return s, nil
}

// URL is where the console is served.
func (s *Server) URL() string {
	scheme := "http"
	if s.cfg.TLS != nil {
		scheme = "https"
	}
	return scheme + "://" + s.lis.Addr().String() + "/"
}

// Close ends every stream and stops serving.
func (s *Server) Close() error {
	s.cancel()
	err := s.http.Close()
	s.wg.Wait()
	return err
}

// Handler serves the console's routes (without the server's timeouts).
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	static, _ := fs.Sub(assets, "assets/static")
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /signin", s.signInPage)
	mux.HandleFunc("POST /signin", s.signIn)
	mux.HandleFunc("POST /signout", s.signOut)
	mux.Handle("GET /{$}", s.page(pagePool))
	mux.Handle("GET /hosts/{id}", s.page(pageHost))
	mux.Handle("GET /leases", s.page(pageLeases))
	mux.Handle("GET /leases/{id}", s.page(pageLease))
	mux.Handle("GET /queue", s.page(pageQueue))
	mux.Handle("GET /tenants", s.page(pageTenants))
	mux.Handle("GET /cluster", s.page(pageCluster))
	mux.HandleFunc("GET /events", s.events)
	return securityHeaders(mux)
}

// securityHeaders forbids everything the console does not use: scripts
// and styles from elsewhere, inline scripts, framing, sniffing.
func securityHeaders(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hd := w.Header()
		hd.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		hd.Set("X-Content-Type-Options", "nosniff")
		// same-origin, not no-referrer: under no-referrer a browser sends
		// "Origin: null" with the console's own forms, which the CSRF
		// check must refuse. Other sites still get no referrer.
		hd.Set("Referrer-Policy", "same-origin")
		hd.Set("X-Frame-Options", "DENY")
		if r.Body != nil {
			r.Body = http.MaxBytesReader(w, r.Body, maxBodyBytes)
		}
		h.ServeHTTP(w, r)
	})
}

// streamLimiter caps the live streams each key (a token, or a client
// address) holds open at once. It is the console's one limit on
// concurrent work per caller.
type streamLimiter struct {
	max  int
	mu   sync.Mutex
	open map[string]int // guarded by mu
}

func newStreamLimiter(max int) *streamLimiter {
	return &streamLimiter{max: max, open: map[string]int{}}
}

// acquire takes a stream for key, or reports false when key holds max.
func (l *streamLimiter) acquire(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[key] >= l.max {
		return false
	}
	l.open[key]++
	return true
}

// release gives back a stream acquire took.
func (l *streamLimiter) release(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[key]--; l.open[key] <= 0 {
		delete(l.open, key)
	}
}
