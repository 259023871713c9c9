package idempotency

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
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
// stay exactly these, and the demo config they name must exist.
func TestREADMEQuickStart(t *testing.T) {
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{
		"go run ./cmd/caddy run --config Caddyfile.example",
		"go test -race -count=1 -timeout 30m ./...",
	} {
		if !strings.Contains(string(b), cmd) {
			t.Errorf("README.md lacks the quick start command %q", cmd)
		}
	}
	if _, err := os.Stat("Caddyfile.example"); err != nil {
		t.Error(err)
	}
}

// Every Caddyfile in the docs that is a whole config (not the syntax
// block, whose <placeholders> are no Caddyfile) adapts as written: a
// user copies them.
func TestDocCaddyfilesAdapt(t *testing.T) {
	block := regexp.MustCompile("(?ms)^```caddyfile\n(.*?)^```")
	n := 0
	for _, f := range docFiles(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range block.FindAllStringSubmatch(string(b), -1) {
			if strings.Contains(m[1], "<") {
				continue
			}
			n++
			_, _, err := adaptCaddyfile(m[1])
			if err != nil && strings.Contains(err.Error(), "directives must appear in a site block") {
				// A snippet of a site: its directives, as they go in one.
				_, _, err = adaptCaddyfile("example.com {\n" + m[1] + "}\n")
			}
			if err != nil {
				t.Errorf("%s: a Caddyfile does not adapt: %v\n%s", f, err, m[1])
			}
		}
	}
	if n == 0 {
		t.Fatal("no Caddyfile found in the docs")
	}
}
