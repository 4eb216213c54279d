package pgcoordtest_test

import (
	"testing"

	"github.com/pgcoord/pgcoord/pgcoordtest"
)

// BenchmarkDB measures what a test's database costs once the server runs
// and the template is migrated: DB's copy of the template and the drop at
// the test's cleanup. The first DB call, which starts the server, is not
// measured.
func BenchmarkDB(b *testing.B) {
	pgcoordtest.DB(b) // the server and the template
	for b.Loop() {
		runTest("TestSomething", func(t testing.TB) { pgcoordtest.DB(t) })
	}
}
