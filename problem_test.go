package idempotency

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// Every problem type links to an anchor of README.md's status codes: one
// that is missing sends a client's developer to the top of the page.
func TestProblemTypesHaveREADMEAnchors(t *testing.T) {
	src, err := os.ReadFile("problem.go")
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	types := regexp.MustCompile(`problemTypeBase \+ "([^"]+)"`).FindAllStringSubmatch(string(src), -1)
	if len(types) == 0 {
		t.Fatal("no problem types found in problem.go")
	}
	for _, m := range types {
		if !strings.Contains(string(readme), `<a id="`+m[1]+`"></a>`) {
			t.Errorf("problem type #%s has no anchor in README.md", m[1])
		}
	}
}
