package pgcoordgocron

// WithClock makes a Locker read the time from now instead of time.Now, so
// that tests can call Lock at chosen moments of the tick grid.
var WithClock = withClock

// TickOf is tickOf: the tick of an interval nearest to a time.
var TickOf = tickOf
