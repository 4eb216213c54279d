// Package pqtest runs package pgcoordsql's checks through lib/pq, a
// database/sql driver that the root module does not require: it is a module
// of its own, with tests only.
package pqtest
