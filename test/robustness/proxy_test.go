package robustness

import (
	"bufio"
	"errors"
	"net"
	"testing"
	"time"
)

// echoServer answers each line with the same line.
func echoServer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					c.Write([]byte(line))
				}
			}()
		}
	}()
	return l.Addr().String()
}

// roundTrip sends a line over c and reads it back within 5s.
func roundTrip(c net.Conn) error {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "ping\n" {
		return errors.New("got " + line)
	}
	return nil
}

func TestProxyCutsAndRestoresAPath(t *testing.T) {
	n := newProxyNetwork()
	t.Cleanup(func() { n.Close() })
	target := echoServer(t)
	addr, err := n.BrokerAddr("host-1", "broker-1", target)
	if err != nil {
		t.Fatal(err)
	}
	if direct, _ := n.BrokerAddr("", "broker-1", target); direct != target {
		t.Fatalf("the observer's address is %s, want the broker's own %s", direct, target)
	}
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := roundTrip(c); err != nil {
		t.Fatalf("through the proxy before any fault: %v", err)
	}

	if err := n.Block("broker-1", "host-1"); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(c); err == nil {
		t.Fatal("a connection on a blocked path still carries data")
	}
	if c2, err := net.Dial("tcp", addr); err == nil {
		if roundTrip(c2) == nil {
			t.Fatal("a new connection on a blocked path carries data")
		}
		c2.Close()
	}

	if err := n.Heal(); err != nil {
		t.Fatal(err)
	}
	c3, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	if err := roundTrip(c3); err != nil {
		t.Fatalf("after Heal: %v", err)
	}
}

func TestProxyRefusesWhatItCannotDo(t *testing.T) {
	n := newProxyNetwork()
	t.Cleanup(func() { n.Close() })
	target := echoServer(t)
	for _, from := range []string{"broker-1", "broker-2"} {
		if _, err := n.BrokerAddr(from, map[string]string{"broker-1": "broker-2", "broker-2": "broker-1"}[from], target); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.Block("broker-1", "broker-2"); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("Block between two brokers: got %v, want ErrUnsupported", err)
	}
	if err := n.Block("host-9", "broker-1"); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("Block on a path without a proxy: got %v, want ErrUnsupported", err)
	}
}
