package pgcoord

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strings"
)

// The runnable examples (example_test.go) read DATABASE_URL, as a program
// would, so that their code works as it stands when copied. setExampleDB
// points DATABASE_URL at a throwaway database of the test server before
// the tests and examples run, whatever the variable held (the examples
// must never touch the database a developer works with); the database is
// dropped after the run (runExampleCleanups).
//
// The testing package runs examples one after the other, with no hook in
// between, so they share this one database: each example takes its own
// keys and names its own elections, semaphores and tables, and releases
// what it takes before it returns.
func setExampleDB() {
	if !flag.Parsed() {
		flag.Parse()
	}
	if !examplesMayRun() {
		return
	}
	defer func() {
		// No test server: the tests say why; the examples fail to connect.
		if r := recover(); r != nil {
			fmt.Fprintln(os.Stderr, "pgcoord: no database for the examples:", r)
		}
	}()
	os.Setenv("DATABASE_URL", DatabaseURLForExample("Examples"))
}

// examplesMayRun reports whether -test.run may select an example of
// example_test.go, so that a run of other tests (or a fuzz run with
// -run '^$') does not start the test server for nothing.
func examplesMayRun() bool {
	run := flag.Lookup("test.run").Value.String()
	if run == "" {
		return true
	}
	re, err := regexp.Compile(strings.Split(run, "/")[0])
	if err != nil {
		return true // the testing package reports the bad pattern
	}
	f, err := parser.ParseFile(token.NewFileSet(), "example_test.go", nil, parser.SkipObjectResolution)
	if err != nil {
		return true
	}
	for _, d := range f.Decls {
		if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv == nil && strings.HasPrefix(fd.Name.Name, "Example") && re.MatchString(fd.Name.Name) {
			return true
		}
	}
	return false
}
