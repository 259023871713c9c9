package idempotency

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// docFiles are the Markdown files that ship with the module and link to
// one another.
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{"README.md", "CONTRIBUTING.md", "CHANGELOG.md"}, files...)
}

var (
	mdHeading = regexp.MustCompile(`(?m)^(#{1,6}) +(.+?) *$`)
	mdAnchor  = regexp.MustCompile(`<a id="([^"]+)"></a>`)
	mdLink    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	mdFence   = regexp.MustCompile("(?ms)^```.*?^```")
)

// githubSlug is the anchor GitHub gives a heading: lower case, markup and
// punctuation dropped (hyphens and underscores kept), spaces as hyphens.
func githubSlug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// docAnchors returns the anchors of a Markdown text: its headings' (a
// repeated heading gets -1, -2, as on GitHub) and its explicit <a id>s.
func docAnchors(text string) map[string]bool {
	text = mdFence.ReplaceAllString(text, "")
	anchors := map[string]bool{}
	seen := map[string]int{}
	for _, m := range mdHeading.FindAllStringSubmatch(text, -1) {
		slug := githubSlug(m[2])
		if n := seen[slug]; n > 0 {
			anchors[slug+"-"+strconv.Itoa(n)] = true
		} else {
			anchors[slug] = true
		}
		seen[slug]++
	}
	for _, m := range mdAnchor.FindAllStringSubmatch(text, -1) {
		anchors[m[1]] = true
	}
	return anchors
}

// A link between the docs that names a missing file or heading sends a
// reader to nowhere, and headings get renamed as the docs are reorganised.
func TestDocLinksResolve(t *testing.T) {
	texts := map[string]string{}
	for _, f := range docFiles(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		texts[f] = string(b)
	}
	for from, text := range texts {
		for _, m := range mdLink.FindAllStringSubmatch(mdFence.ReplaceAllString(text, ""), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, frag, _ := strings.Cut(target, "#")
			path := from
			if file != "" {
				path = filepath.Clean(filepath.Join(filepath.Dir(from), file))
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s links to %s: no such file", from, target)
					continue
				}
			}
			if frag == "" {
				continue
			}
			linked, ok := texts[path]
			if !ok {
				t.Errorf("%s links to %s: an anchor in a file that is not a doc", from, target)
				continue
			}
			if !docAnchors(linked)[frag] {
				t.Errorf("%s links to %s: %s has no anchor #%s", from, target, path, frag)
			}
		}
	}
}

// Each page's title is its H1; an H2 that says it again (or its part
// before a colon) pushes the page's content one level down for nothing.
func TestDocPagesDoNotRepeatTheirTitle(t *testing.T) {
	for _, f := range docFiles(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var title string
		for _, m := range mdHeading.FindAllStringSubmatch(mdFence.ReplaceAllString(string(b), ""), -1) {
			switch {
			case len(m[1]) == 1 && title == "":
				title = m[2]
			case len(m[1]) == 1:
				t.Errorf("%s has a second H1 %q", f, m[2])
			case len(m[1]) == 2 && (m[2] == title || strings.HasPrefix(title, m[2]+":")):
				t.Errorf("%s repeats its title %q as an H2", f, title)
			}
		}
	}
}

// The quick start is the first thing a user runs: its two commands must
// stay exactly these, the test command the one that make test and CI run,
// and the demo config they name must exist.
func TestREADMEQuickStart(t *testing.T) {
	readme := readDoc(t, "README.md")
	const testCmd = "go test -race -count=1 -timeout 30m ./..."
	for _, cmd := range []string{"go run ./cmd/caddy run --config Caddyfile.example", testCmd} {
		if !strings.Contains(readme, cmd) {
			t.Errorf("README.md lacks the quick start command %q", cmd)
		}
	}
	if !strings.Contains(readDoc(t, "Makefile"), "test:\n\t"+testCmd+"\n") {
		t.Errorf("make test does not run the README's %q", testCmd)
	}
	if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(testCmd) + `$`).MatchString(readDoc(t, ".ci/run")) {
		t.Errorf(".ci/run does not run the README's %q", testCmd)
	}
	if _, err := os.Stat("Caddyfile.example"); err != nil {
		t.Error(err)
	}
}

// The README's build by hand names the versions that make xcaddy uses
// (the Makefile's XCADDY_VERSION, go.mod's Caddy, version.go's Version),
// and the supported Caddy range is go.mod's Caddy to the Makefile's
// CADDY_NEWEST: a release that moves one must move the README too.
func TestREADMEBuildVersions(t *testing.T) {
	readme := readDoc(t, "README.md")
	makefile := readDoc(t, "Makefile")
	find := func(file, text, re string) string {
		t.Helper()
		m := regexp.MustCompile(re).FindStringSubmatch(text)
		if m == nil {
			t.Fatalf("%s: no match for %s", file, re)
		}
		return m[1]
	}
	xcaddy := find("Makefile", makefile, `(?m)^XCADDY_VERSION \?= (\S+)$`)
	newest := find("Makefile", makefile, `(?m)^CADDY_NEWEST \?= (\S+)$`)
	oldest := find("go.mod", readDoc(t, "go.mod"), `(?m)^\s*github.com/caddyserver/caddy/v2 (\S+)$`)
	for _, want := range []string{
		"go install github.com/caddyserver/xcaddy/cmd/xcaddy@" + xcaddy + "\n",
		"xcaddy build " + oldest + " --with github.com/caddy-idempotency/idempotency@" + Version + "=.\n",
		"Supported Caddy: " + oldest + " to " + newest,
	} {
		if !strings.Contains(readme, want) {
			t.Errorf("README.md lacks %q", want)
		}
	}
}

func readDoc(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// mdCaddyfileFence is a ```caddyfile block, its fence indented or not (a
// block in a list item is indented as the item's text).
var mdCaddyfileFence = regexp.MustCompile("(?ms)^( *)```caddyfile\n(.*?)^ *```")

// docCaddyfile is a Caddyfile that a user may copy: a ```caddyfile block of
// a doc, or a whole file.
type docCaddyfile struct {
	where string // file:line of its first line
	text  string // as a user gets it: the fence's indentation removed
}

// docCaddyfiles returns the ```caddyfile blocks of the docs and the whole
// of Caddyfile.example.
func docCaddyfiles(t *testing.T) []docCaddyfile {
	t.Helper()
	var out []docCaddyfile
	for _, f := range docFiles(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		for _, m := range mdCaddyfileFence.FindAllStringSubmatchIndex(text, -1) {
			indent := text[m[2]:m[3]]
			lines := strings.SplitAfter(text[m[4]:m[5]], "\n")
			for i, l := range lines {
				lines[i] = strings.TrimPrefix(l, indent)
			}
			line := strings.Count(text[:m[4]], "\n") + 1
			out = append(out, docCaddyfile{f + ":" + strconv.Itoa(line), strings.Join(lines, "")})
		}
	}
	b, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	return append(out, docCaddyfile{"Caddyfile.example:1", string(b)})
}

// A Caddyfile that is not as `caddy fmt` writes it makes Caddy warn
// "input is not formatted" at every start: each one a user may copy must
// be formatted already (tabs, one space between tokens). A syntax summary
// with <placeholders> is no Caddyfile and is fenced as text.
func TestDocCaddyfilesAreFormatted(t *testing.T) {
	cfs := docCaddyfiles(t)
	for _, cf := range cfs {
		if got := string(caddyfile.Format([]byte(cf.text))); got != cf.text {
			t.Errorf("%s: a Caddyfile is not as caddy fmt writes it; want:\n%s\ngot:\n%s", cf.where, got, cf.text)
		}
	}
	if len(cfs) < 2 {
		t.Fatal("no Caddyfile found in the docs")
	}
}

// Every Caddyfile in the docs adapts as written, and a whole config (not a
// snippet of a site) without a warning: a user copies them. The demo is
// bound to the loopback addresses only.
func TestDocCaddyfilesAdapt(t *testing.T) {
	for _, cf := range docCaddyfiles(t) {
		if strings.Contains(cf.text, "<") {
			t.Errorf("%s: a ```caddyfile block with <placeholders>: fence a syntax summary as text", cf.where)
			continue
		}
		_, warnings, err := adaptCaddyfile(cf.text)
		if err != nil && strings.Contains(err.Error(), "directives must appear in a site block") {
			// A snippet of a site: its directives, as they go in one.
			_, _, err = adaptCaddyfile("example.com {\n" + cf.text + "}\n")
			warnings = nil
		}
		if err != nil {
			t.Errorf("%s: a Caddyfile does not adapt: %v\n%s", cf.where, err, cf.text)
		}
		for _, w := range warnings {
			t.Errorf("%s: adapting warns: %s", cf.where, w.String())
		}
	}
	b, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _, err := adaptCaddyfile(string(b))
	if err != nil {
		t.Fatal(err)
	}
	var demo struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Listen []string `json:"listen"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(cfg, &demo); err != nil {
		t.Fatal(err)
	}
	for name, srv := range demo.Apps.HTTP.Servers {
		for _, addr := range srv.Listen {
			host, _, err := net.SplitHostPort(strings.TrimPrefix(addr, "tcp/"))
			if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
				t.Errorf("Caddyfile.example: server %s listens on %q, not a loopback address only", name, addr)
			}
		}
		if len(srv.Listen) == 0 {
			t.Errorf("Caddyfile.example: server %s listens on every interface", name)
		}
	}
}
