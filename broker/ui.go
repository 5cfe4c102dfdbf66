package broker

import (
	"crypto/tls"
	"fmt"
	"net"

	"github.com/gpupool/gpupool/broker/console"
)

// UIConfig configures the web console a broker serves (package console).
type UIConfig struct {
	// Bind is the console's HTTP(S) listen address; empty serves none.
	Bind string
	// StreamsPerToken caps the live streams one token (or, with ACL off,
	// one client address) holds open at once (console.DefaultStreamsPerToken
	// when 0).
	StreamsPerToken int
}

type uiServer = console.Server

func (c UIConfig) validate() error {
	if c.Bind != "" {
		if _, port, err := net.SplitHostPort(c.Bind); err != nil || port == "" {
			return fmt.Errorf("broker: --ui-bind %q: must be HOST:PORT, e.g. 127.0.0.1:7701", c.Bind)
		}
	}
	if c.StreamsPerToken < 0 {
		return fmt.Errorf("broker: --ui-streams-per-token %d: must be 0 (the default, %d) or more", c.StreamsPerToken, console.DefaultStreamsPerToken)
	}
	return nil
}

// startUI starts the console when Config.UI.Bind is set. It reads through
// the broker's own gRPC API, dialled like a peer, with the signed-in
// user's token: every page and stream passes the same ACL checks as the
// API, and a follower's console gets leader memory from the leader.
func (s *Server) startUI() error {
	if s.cfg.UI.Bind == "" {
		return nil
	}
	conn, err := s.membership.connTo(s.Addr())
	if err != nil {
		return fmt.Errorf("broker: console: dial own gRPC at %s: %w", s.Addr(), err)
	}
	var web *tls.Config
	if s.cfg.TLS != nil {
		web = s.cfg.TLS.WebConfig()
	}
	ui, err := console.New(console.Config{
		Bind: s.cfg.UI.Bind, Conn: conn, ACL: s.cfg.ACL, TLS: web, ServerID: s.cfg.NodeID,
		StreamsPerToken: s.cfg.UI.StreamsPerToken, Logger: s.log.With("component", "console"),
	})
	if err != nil {
		return fmt.Errorf("broker: --ui-bind %s: %w", s.cfg.UI.Bind, err)
	}
	s.ui = ui
	s.log.Info("console serving", "url", ui.URL())
	return nil
}

// UIURL is the console's URL, or "" when it serves none.
func (s *Server) UIURL() string {
	if s.ui == nil {
		return ""
	}
	return s.ui.URL()
}

func (s *Server) stopUI() {
	if s.ui != nil {
		s.ui.Close()
	}
}
