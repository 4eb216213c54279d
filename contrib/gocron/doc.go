// Package pgcoordgocron runs gocron (github.com/go-co-op/gocron/v2) jobs
// on one instance of a fleet, coordinated through PostgreSQL with pgcoord
// instead of Redis or etcd.
//
// Two ways, as gocron offers:
//
//   - Elector (gocron.WithDistributedElector): the instances elect a
//     leader, and only the leader's scheduler runs jobs. When the leader's
//     process dies, another instance leads within milliseconds. IsLeader
//     answers from local state, so it costs nothing per run, and says no
//     as soon as the leadership is lost or in doubt, including right after
//     a pause of the process longer than the loss deadline. This is the
//     choice when clock differences between instances must not matter.
//     Runs already started go on when the leadership ends, and when both
//     of the leader's connections are lost together a new leader may start
//     runs while the old one still says yes for up to two heartbeat
//     intervals; jobs whose writes must never come from an old leader
//     fence them with the term (see Elector).
//   - Locker (gocron.WithDistributedLocker): every instance schedules
//     every job, and each run first tries a lock; the instance that gets
//     it runs, the others skip the run. With WithTicks(interval), the
//     recommended mode, the lock is that of the job's tick: time is cut
//     into ticks of interval since the Unix epoch, Lock takes the tick
//     nearest to the moment it is called, and holds it one and a half
//     intervals, so each tick runs exactly once across the instances, even
//     when their timers fire up to interval/2 after (or before) the tick
//     by their own clocks, and the next tick is never skipped because of
//     its predecessor. It asks that the schedules be aligned to the grid
//     (cron jobs, or duration jobs with a common gocron.WithStartAt on the
//     grid) and that clocks differ by less than interval/2 (NTP); see
//     WithTicks. Without WithTicks, which needs no grid, the lock is that
//     of the job, held at least a minimum time (WithMinHold, one second):
//     the job runs at most once per minimum hold, but an instance later
//     than the hold runs a tick again. In both modes, runs of a job do not
//     overlap while their locks are held; a lock lost during a run (its
//     backend terminated, its connection broken, a server restart) lets
//     another instance run the job while that run goes on, as gocron
//     cannot stop a run. JobLock.Done tells of the loss (see Locker).
//
// Elections need the tables of pgcoord.Migrate; the Locker needs none.
//
// Usage with an Elector:
//
//	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"))
//	if err != nil { ... }
//	defer c.Close(context.Background())
//	el, err := pgcoordgocron.NewElector(ctx, c, "reports")
//	if err != nil { ... }
//	defer el.Close(context.Background())
//	s, err := gocron.NewScheduler(gocron.WithDistributedElector(el))
//	if err != nil { ... }
//	_, err = s.NewJob(gocron.DurationJob(time.Minute), gocron.NewTask(sendReports))
//	s.Start()
//	defer s.Shutdown()
//
// Usage with a Locker, for jobs on a minute grid:
//
//	lk, err := pgcoordgocron.NewLocker(c, pgcoordgocron.WithTicks(time.Minute))
//	if err != nil { ... }
//	defer lk.Close(context.Background())
//	s, err := gocron.NewScheduler(gocron.WithDistributedLocker(lk))
//	if err != nil { ... }
//	_, err = s.NewJob(gocron.CronJob("*/5 * * * *", false), gocron.NewTask(cleanup))
//
// Shut the scheduler down before closing the Elector or the Locker, and
// those before the Client (defers run in reverse order, as above).
package pgcoordgocron
