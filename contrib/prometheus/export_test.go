package pgcoordprom

// TermLabels returns how many election labels c keeps a highest term for.
func TermLabels(c *Collector) int { return c.mapper.TermLabels() }
