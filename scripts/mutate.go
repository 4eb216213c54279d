//go:build ignore

// mutate applies one mutant of scripts/mutants to a copy of the tree, or
// checks that every mutant still applies. A mutant file has header lines
// (file, run, flags, promise; see scripts/mutants/README.md), then the
// snippet to find and its replacement:
//
//	<<<< find
//	...lines that occur exactly once in file...
//	==== replace
//	...lines that take their place...
//	>>>>
//
// Usage:
//
//	go run scripts/mutate.go apply MUTANT DIR   # edit DIR/file in place
//	go run scripts/mutate.go check DIR MUTANT...  # every snippet occurs once in DIR
//	go run scripts/mutate.go field MUTANT NAME  # print a header field
//
// It exits 2 when a snippet does not occur exactly once, or a file is
// malformed.
package main

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

type mutant struct {
	path    string
	fields  map[string]string
	find    string
	replace string
}

func parse(path string) (*mutant, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m := &mutant{path: path, fields: map[string]string{}}
	var find, repl []string
	state := "header"
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case state == "header" && line == "<<<< find":
			state = "find"
		case state == "header":
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				return nil, fmt.Errorf("%s: header line %q is not name: value", path, line)
			}
			k = strings.TrimSpace(k)
			if prev, dup := m.fields[k]; dup {
				v = prev + " " + strings.TrimSpace(v) // a field continued on the next line
			}
			m.fields[k] = strings.TrimSpace(v)
		case state == "find" && line == "==== replace":
			state = "replace"
		case state == "find":
			find = append(find, line)
		case state == "replace" && line == ">>>>":
			state = "done"
		case state == "replace":
			repl = append(repl, line)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if state != "done" || len(find) == 0 {
		return nil, fmt.Errorf("%s: want a <<<< find, ==== replace, >>>> block", path)
	}
	for _, k := range []string{"file", "run", "promise"} {
		if m.fields[k] == "" {
			return nil, fmt.Errorf("%s: no %s: line", path, k)
		}
	}
	m.find = strings.Join(find, "\n") + "\n"
	m.replace = strings.Join(repl, "\n")
	if len(repl) > 0 {
		m.replace += "\n"
	}
	return m, nil
}

// target reads m's file in dir and checks that the snippet occurs once.
func (m *mutant) target(dir string) (string, string, error) {
	file := filepath.Join(dir, m.fields["file"])
	b, err := os.ReadFile(file)
	if err != nil {
		return "", "", err
	}
	if n := strings.Count(string(b), m.find); n != 1 {
		return "", "", fmt.Errorf("%s: its snippet occurs %d times in %s, want exactly once", m.path, n, m.fields["file"])
	}
	return file, string(b), nil
}

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: mutate apply MUTANT DIR | check DIR MUTANT... | field MUTANT NAME")
		os.Exit(2)
	}
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "mutate:", err)
		os.Exit(2)
	}
	switch os.Args[1] {
	case "apply":
		if len(os.Args) != 4 {
			fail(fmt.Errorf("apply MUTANT DIR"))
		}
		m, err := parse(os.Args[2])
		if err != nil {
			fail(err)
		}
		file, text, err := m.target(os.Args[3])
		if err != nil {
			fail(err)
		}
		if err := os.WriteFile(file, []byte(strings.Replace(text, m.find, m.replace, 1)), 0o644); err != nil {
			fail(err)
		}
	case "check":
		bad := false
		for _, p := range os.Args[3:] {
			m, err := parse(p)
			if err == nil {
				_, _, err = m.target(os.Args[2])
			}
			if err != nil {
				fmt.Fprintln(os.Stderr, "mutate:", err)
				bad = true
			}
		}
		if bad {
			os.Exit(2)
		}
	case "field":
		if len(os.Args) != 4 {
			fail(fmt.Errorf("field MUTANT NAME"))
		}
		m, err := parse(os.Args[2])
		if err != nil {
			fail(err)
		}
		fmt.Println(m.fields[os.Args[3]])
	default:
		fail(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}
