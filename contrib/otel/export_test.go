package pgcoordotel

// TermLabels returns how many election labels m keeps a highest term for.
func TermLabels(m *Metrics) int { return m.mapper.TermLabels() }
