package protocol

import (
	"fmt"
	"strings"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// MaxTokenTTL bounds an ACL token's lifetime when one is given.
const MaxTokenTTL = 10 * 365 * 24 * time.Hour

// TokenKindName is a token kind as the CLI spells it: management, client.
func TokenKindName(k gpupoolv1.TokenKind) string {
	return strings.ToLower(strings.TrimPrefix(k.String(), "TOKEN_KIND_"))
}

// ActorText is an actor as people read it: "name (accessor)", or the name
// alone for the broker and anonymous callers; "unknown" when none was
// recorded.
func ActorText(a *gpupoolv1.Actor) string {
	switch {
	case a == nil:
		return "unknown"
	case a.AccessorId == "":
		return a.Name
	}
	return fmt.Sprintf("%s (%s)", a.Name, a.AccessorId)
}
