// api/ holds the exported API of the last release (scripts/check-api.sh),
// not code. This go.mod keeps it out of the root module's zip, which the
// module proxy serves to every user; "apibaseline" is no importable path.
module apibaseline

go 1.25.0
