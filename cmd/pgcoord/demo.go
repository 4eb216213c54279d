package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/pgcoord/pgcoord"
)

// The keys the demo takes, by name ("pgcoord key demo/report" prints them).
var demoKeys = []string{"demo/report", "demo/cache", "demo/account/1", "demo/account/2"}

// demoNames maps the demo's keys to their names.
func demoNames() map[pgcoord.Key]string {
	m := make(map[pgcoord.Key]string, len(demoKeys))
	for _, n := range demoKeys {
		m[pgcoord.HashKey(n)] = n
	}
	return m
}

func demoCmd(*flag.FlagSet) func(context.Context, *env, []string) error {
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("demo takes no arguments")
		}
		a, closeA, err := openClient(ctx, e)
		if err != nil {
			return err
		}
		defer closeA()
		b, closeB, err := openClient(ctx, e)
		if err != nil {
			return err
		}
		defer closeB()
		report, cache := pgcoord.HashKey("demo/report"), pgcoord.HashKey("demo/cache")
		accounts := []pgcoord.Key{pgcoord.HashKey("demo/account/1"), pgcoord.HashKey("demo/account/2")}

		var held []*pgcoord.Lock
		defer func() {
			for _, l := range held {
				_ = l.Unlock(context.WithoutCancel(ctx))
			}
		}()
		take := func(l *pgcoord.Lock, err error) error {
			if err == nil {
				held = append(held, l)
			}
			return err
		}
		if err := take(a.TryLock(ctx, report)); err != nil {
			return fmt.Errorf("demo/report: %w (is another demo running?)", err)
		}
		if err := take(a.TryRLock(ctx, cache)); err != nil {
			return err
		}
		if err := take(b.TryRLock(ctx, cache)); err != nil {
			return err
		}
		if err := take(b.LockAll(ctx, accounts...)); err != nil {
			return err
		}
		// Report every lock that ends before the demo does (an operator
		// ran "pgcoord release", say).
		lost := make(chan string, len(held)+1)
		watch := func(name string, l *pgcoord.Lock) {
			go func() {
				select {
				case <-l.Done():
					if err := l.Err(); !errors.Is(err, pgcoord.ErrNotHeld) && !errors.Is(err, pgcoord.ErrClosed) {
						lost <- fmt.Sprintf("%s ended: %v", name, err)
					}
				case <-ctx.Done():
				}
			}()
		}
		for i, name := range []string{"demo/report", "demo/cache", "demo/cache", "demo/account/1 and 2"} {
			watch(name, held[i])
		}
		// The second client waits for the report, and holds it once it
		// has it, until the demo ends.
		waited := make(chan struct{})
		go func() {
			defer close(waited)
			l, err := b.Lock(ctx, report)
			if err != nil {
				return
			}
			lost <- "the second client now holds demo/report"
			<-ctx.Done()
			_ = l.Unlock(context.WithoutCancel(ctx))
		}()

		fmt.Fprintln(e.stdout, "holding, as two clients with application_name \"pgcoord\":")
		fmt.Fprintln(e.stdout, "  demo/report     exclusive; the second client waits for it")
		fmt.Fprintln(e.stdout, "  demo/cache      shared by both clients")
		fmt.Fprintln(e.stdout, "  demo/account/1  exclusive, with demo/account/2 (LockAll)")
		fmt.Fprintln(e.stdout, "run \"pgcoord locks\" to see them; interrupt (Ctrl-C) to release them and exit")
		for {
			select {
			case <-ctx.Done():
				<-waited
				fmt.Fprintln(e.stdout, "released")
				return nil
			case msg := <-lost:
				fmt.Fprintln(e.stdout, msg)
			}
		}
	}
}
