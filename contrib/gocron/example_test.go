package pgcoordgocron_test

import (
	"context"
	"log"
	"os"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/pgcoord/pgcoord"
	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
)

// Only the scheduler of the process that leads the election "reports"
// runs the job; when that process dies, another one takes over. It needs
// a server at DATABASE_URL with the tables of pgcoord.Migrate, so it is
// compiled, not run.
func ExampleNewElector() {
	ctx := context.Background()
	// snippet:start
	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close(context.Background())
	el, err := pgcoordgocron.NewElector(ctx, c, "reports")
	if err != nil {
		log.Fatal(err)
	}
	defer el.Close(context.Background())
	s, err := gocron.NewScheduler(gocron.WithDistributedElector(el))
	if err != nil {
		log.Fatal(err)
	}
	_, err = s.NewJob(gocron.DurationJob(time.Minute), gocron.NewTask(func() {
		log.Println("sending reports: this process leads")
	}))
	if err != nil {
		log.Fatal(err)
	}
	s.Start()
	defer s.Shutdown()
	// snippet:end
}

// Every process schedules the jobs; each tick of a job runs once, in the
// one process that takes the tick's lock. The Locker's ticks are whole
// minutes since the epoch: the cron job runs every five minutes on that
// grid, and the duration job every ten minutes from a start on its own
// ten-minute grid, the same in every process. A process whose timer fires
// less than 30 seconds late finds the tick run already.
func ExampleWithTicks() {
	ctx := context.Background()
	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close(context.Background())
	lk, err := pgcoordgocron.NewLocker(c, pgcoordgocron.WithTicks(time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	defer lk.Close(context.Background())
	s, err := gocron.NewScheduler(gocron.WithDistributedLocker(lk))
	if err != nil {
		log.Fatal(err)
	}
	_, err = s.NewJob(gocron.CronJob("*/5 * * * *", false), gocron.NewTask(func() { log.Println("cleanup") }),
		gocron.WithName("cleanup"))
	if err != nil {
		log.Fatal(err)
	}
	const every = 10 * time.Minute
	start := time.Now().Truncate(every).Add(every) // Truncate is epoch-aligned for divisors of a day
	_, err = s.NewJob(gocron.DurationJob(every), gocron.NewTask(func() { log.Println("rollup") }),
		gocron.WithName("rollup"), gocron.WithStartAt(gocron.WithStartDateTime(start)))
	if err != nil {
		log.Fatal(err)
	}
	s.Start()
	defer s.Shutdown()
}

// Without WithTicks, the Locker takes one lock per job, held at least
// the minimum hold: a process whose timer fires less than 10 seconds
// after the winner's skips the run.
func ExampleNewLocker() {
	ctx := context.Background()
	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close(context.Background())
	lk, err := pgcoordgocron.NewLocker(c, pgcoordgocron.WithMinHold(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer lk.Close(context.Background())
	s, err := gocron.NewScheduler(gocron.WithDistributedLocker(lk))
	if err != nil {
		log.Fatal(err)
	}
	_, err = s.NewJob(gocron.DurationJob(time.Minute), gocron.NewTask(func() { log.Println("cleanup") }),
		gocron.WithName("cleanup"))
	if err != nil {
		log.Fatal(err)
	}
	s.Start()
	defer s.Shutdown()
}
