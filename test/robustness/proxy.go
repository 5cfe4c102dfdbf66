package robustness

import (
	"fmt"
	"net"
	"os/exec"
	"sync"
	"time"
)

// proxyNetwork is the fallback where network namespaces cannot be
// created: every node binds its own 127.0.0.x address, and a node that
// dials a broker's gRPC address dials a TCP proxy of its own instead,
// which can refuse, cut or slow the connection.
//
// Raft's transport dials the address each server advertises, so the
// proxy cannot stand between two brokers: Block between brokers returns
// ErrUnsupported (the fault scheduler pauses the process with SIGSTOP
// instead), and Degrade slows only the proxied links, without loss.
type proxyNetwork struct {
	mu      sync.Mutex
	nodes   map[string]string  // node → IP; guarded by mu
	proxies map[pathKey]*proxy // guarded by mu
	brokers map[string]bool    // nodes that own a broker address; guarded by mu
}

type pathKey struct{ from, to string }

func newProxyNetwork() *proxyNetwork {
	return &proxyNetwork{nodes: map[string]string{}, proxies: map[pathKey]*proxy{}, brokers: map[string]bool{}}
}

func (n *proxyNetwork) Kind() string { return "proxy" }

func (n *proxyNetwork) Describe() string {
	return "TCP proxies on 127.0.0.1 between agents and brokers (no network namespaces): " +
		"broker-to-broker partitions become SIGSTOP pauses, no asymmetric partition, slow links without loss"
}

func (n *proxyNetwork) AddNode(name string) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	ip := fmt.Sprintf("127.0.0.%d", 20+len(n.nodes))
	n.nodes[name] = ip
	return ip, nil
}

func (n *proxyNetwork) Command(_ string, cmd *exec.Cmd) *exec.Cmd { return cmd }

func (n *proxyNetwork) BrokerAddr(from, to, addr string) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.brokers[to] = true
	if from == "" {
		return addr, nil // the observer is never cut off
	}
	k := pathKey{from, to}
	if p := n.proxies[k]; p != nil {
		return p.ln.Addr().String(), nil
	}
	p, err := newProxy(addr)
	if err != nil {
		return "", err
	}
	n.proxies[k] = p
	return p.ln.Addr().String(), nil
}

func (n *proxyNetwork) Block(from, to string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.brokers[from] && n.brokers[to] {
		return fmt.Errorf("a partition between brokers %s and %s: %w (raft dials advertised addresses)", from, to, ErrUnsupported)
	}
	found := false
	for k, p := range n.proxies {
		if (k.from == from && k.to == to) || (k.from == to && k.to == from) {
			p.setBlocked(true)
			found = true
		}
	}
	if !found {
		return fmt.Errorf("no proxied path between %s and %s: %w", from, to, ErrUnsupported)
	}
	return nil
}

func (n *proxyNetwork) Degrade(node string, delay time.Duration, lossPct float64) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for k, p := range n.proxies {
		if k.from == node || k.to == node {
			p.setDelay(delay)
		}
	}
	return fmt.Sprintf("proxy delay %s per chunk (loss %.1f%% not possible over TCP)", delay, lossPct), nil
}

func (n *proxyNetwork) Heal() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, p := range n.proxies {
		p.setBlocked(false)
		p.setDelay(0)
	}
	return nil
}

func (n *proxyNetwork) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, p := range n.proxies {
		p.close()
	}
	n.proxies = map[pathKey]*proxy{}
	return nil
}

// proxy forwards every connection accepted on ln to target. While
// blocked it cuts its connections and refuses new ones.
type proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	blocked bool                  // guarded by mu
	delay   time.Duration         // guarded by mu
	conns   map[net.Conn]struct{} // guarded by mu
}

func newProxy(target string) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	go p.serve()
	return p, nil
}

func (p *proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.handle(c)
	}
}

func (p *proxy) handle(c net.Conn) {
	p.mu.Lock()
	blocked := p.blocked
	p.mu.Unlock()
	if blocked {
		c.Close()
		return
	}
	up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	p.conns[c], p.conns[up] = struct{}{}, struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { p.copy(up, c); done <- struct{}{} }()
	go func() { p.copy(c, up); done <- struct{}{} }()
	<-done
	c.Close()
	up.Close()
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// copy copies src to dst, holding each chunk for the current delay.
func (p *proxy) copy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			d := p.delay
			p.mu.Unlock()
			if d > 0 {
				time.Sleep(d) // the injected fault itself: a slow link
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // EOF or a cut connection: handle closes both sides
		}
	}
}

func (p *proxy) setBlocked(b bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.blocked = b
	if b {
		for c := range p.conns {
			c.Close()
		}
	}
}

func (p *proxy) setDelay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
}

func (p *proxy) close() {
	p.ln.Close()
	p.setBlocked(true)
}
